"""The embedded tiny world, the classroom's demo, apart from the trainer: world.py (an invented
encyclopedia and its questions), teachers.py (a scripted, imperfect teacher for each protocol),
sft.py (tokenizer, tiny Qwen2 policy, SFT warm start; `python -m tiny.sft --config C` builds it),
warm_start.py (your own model's warm start on the teacher), papers.py and report.py (the
reproductions that reproduce.py runs). The trainer reaches it only through the top-level data.py."""
