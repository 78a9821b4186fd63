"""Evaluation harness: perplexity, retrieval probes, synthetic-task accuracy, mechanism probes,
generation, an lm-evaluation-harness adapter, and run-level reports."""
