"""``MoEMonitor`` (``callback``): per-expert load, router entropy and drops over a window of steps,
summed over ranks by a torchmetrics ``Metric`` (``metric``) and drawn as heatmaps (``plots``)."""
