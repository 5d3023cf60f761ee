"""Downstream evaluation: eval sets, linear probes, few-shot, zero-shot (used by pipeline/stages/evaluate.py)."""
