"""The wallet port, the embedded wallet, and the reconciliation of orphan debits."""
