"""The search engine the agent calls: corpus.py (the jsonl as byte spans), index.py (BM25, dense,
hybrid), web.py (operators and READ), server.py (HTTP server and client), tools.py (what a
rollout calls, chosen by `retriever.*`). `python retriever.py` is the command line."""
