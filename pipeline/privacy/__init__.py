"""The DP boundary: sampling, the mechanism plan, the one DP step, clipping, the ledger, accounting
and its checks, the privacy budget, and what may run outside ε (README.md lists every invariant)."""
