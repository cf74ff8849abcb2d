"""What a run reports: metrics.py (every paper's metric from rollout records), plots.py (training
curves, `python eval.py curves RUN`), viewer.py (the HTML trajectory viewer, `python eval.py view`)."""
