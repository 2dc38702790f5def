"""Dispatch plans that never read a count back to the host: every exchange sized by a row budget
(``budget.RowBudget``), through the padded all-to-all (``padded``) or symmetric memory (``symmetric``,
with the pull kernels of ``symm_pull``)."""
