"""What the agent writes and how it is read: protocols.py (tags and tools of each paper's agent),
answers.py (the one parser of model output; EM / F1), judge.py (LLM or rule judge), bapo.py
(BAPO's modulator stage, R_correct and resampling around rewards.bapo)."""
