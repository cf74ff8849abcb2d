"""Could a policy's confidence follow its correctness, and does it? Two probes on eval rollouts.

    python eval.py --config C --model start=POLICY --datasets W/val.jsonl W/test.jsonl \
        --set eval.max_questions=2000 --judge-url rule --out E      # greedy rollouts, both splits
    python benchmarks/probes/confidence_probe.py linear POLICY E/rollouts/start__val.jsonl E/rollouts/start__test.jsonl
    python benchmarks/probes/confidence_probe.py certain LABEL=POLICY=ROLLOUTS.jsonl [LABEL=POLICY=ROLLOUTS.jsonl ...]

For rollouts whose confidence follows the answer (`rollout.confidence_after_answer`):
- linear:  is correctness linearly decodable from the policy's hidden states where the answer
           starts (the "<answer>" token) and where the confidence digit is predicted? A logistic
           regression per layer, fit on the first file, scored (ROC AUC) on the second. High AUC
           at the digit means the feature a calibrated confidence needs is already there.
- certain: does the policy use it? P(confidence >= 5) at the digit, teacher-forced on each
           model's own answers, its mean on right and on wrong answers, and its AUC for being
           right (Deliberative Searcher's zeta = 5). The greedy evaluation shows a calibration
           only once the argmax flips; this shows the drift before.
Measured (results/LOG.md, 2026-11-23), the papers' start with the confidence after the answer:
linear AUC 0.87-0.91 at the digit vs 0.59-0.71 at the answer (layers 1-4); P(>= 5) right / wrong
0.597 / 0.597 at the start, 0.529 / 0.529 after 20 Lagrangian steps at lr 2e-4, 0.408 / 0.399 at 1e-3.
"""

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def answered(path: str):
    """(record, prompt + response ids) for each answered rollout with a confidence after its answer."""
    for line in open(path):
        r = json.loads(line)
        if r.get("finish") != "answer" or "</confidence>" not in r["response_text"].rsplit("</answer>", 1)[-1]:
            continue
        yield r, r["prompt_ids"] + r["response_ids"]


def digit_index(tok, ids: list[int]) -> int | None:
    """The first token after the last </answer> that holds a digit."""
    end = tok.convert_tokens_to_ids("</answer>")
    e = max(i for i, t in enumerate(ids) if t == end)
    return next((j for j in range(e + 1, len(ids)) if re.search(r"\d", tok.decode([ids[j]]))), None)


def hidden_features(model, tok, path: str):
    """Per rollout: the hidden states (every layer) at the <answer> token and before the digit."""
    import numpy as np
    import torch

    from agent.answers import exact_match

    start = tok.convert_tokens_to_ids("<answer>")
    feats, right = {"answer": [], "digit": []}, []
    for r, ids in answered(path):
        d = digit_index(tok, ids)
        if d is None:
            continue
        a = max(i for i, t in enumerate(ids) if t == start)
        with torch.no_grad():
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[1:]
        feats["answer"].append(np.stack([h[0, a].float().numpy() for h in hs]))
        feats["digit"].append(np.stack([h[0, d - 1].float().numpy() for h in hs]))
        right.append(exact_match(r["answer"], r["golden_answers"]))
    return {k: np.array(v) for k, v in feats.items()}, np.array(right)


def linear(policy: str, fit: str, score: str) -> None:
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok, model = AutoTokenizer.from_pretrained(policy), AutoModelForCausalLM.from_pretrained(policy).eval()
    (xf, yf), (xs, ys) = hidden_features(model, tok, fit), hidden_features(model, tok, score)
    print(f"fit on {len(yf)} answers (right {yf.mean():.3f}), scored on {len(ys)} (right {ys.mean():.3f})")
    for where in ("answer", "digit"):
        aucs = []
        for layer in range(xf[where].shape[1]):
            clf = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=5000))
            clf.fit(xf[where][:, layer], yf)
            aucs.append(roc_auc_score(ys, clf.predict_proba(xs[where][:, layer])[:, 1]))
        print(f"{where:6s} test AUC by layer: " + " ".join(f"{a:.3f}" for a in aucs))


def certain(specs: list[str]) -> None:
    import numpy as np
    import torch
    from sklearn.metrics import roc_auc_score
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent.answers import exact_match

    for spec in specs:
        label, policy, path = spec.split("=", 2)
        tok, model = AutoTokenizer.from_pretrained(policy), AutoModelForCausalLM.from_pretrained(policy).eval()
        vocab = tok.get_vocab()
        high = [vocab[f"Ġ{k}"] for k in range(5, 11)]  # " 5" .. " 10" are single tokens in the tiny BPE
        low = [vocab[f"Ġ{k}"] for k in range(1, 5)]
        p_certain, right = [], []
        for r, ids in answered(path):
            d = digit_index(tok, ids)
            if d is None:
                continue
            with torch.no_grad():
                prob = torch.softmax(model(torch.tensor([ids[:d]])).logits[0, -1].float(), -1)
            hi, lo = prob[high].sum().item(), prob[low].sum().item()
            p_certain.append(hi / max(hi + lo, 1e-9))
            right.append(exact_match(r["answer"], r["golden_answers"]))
        p, y = np.array(p_certain), np.array(right)
        print(f"{label}: {len(y)} answers, right {y.mean():.3f}, P(>=5) right {p[y == 1].mean():.3f} "
              f"wrong {p[y == 0].mean():.3f}, AUC {roc_auc_score(y, p):.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="probe", required=True)
    lin = sub.add_parser("linear", help="is correctness decodable at the answer and at the digit?")
    lin.add_argument("policy", help="policy or checkpoint directory")
    lin.add_argument("fit", help="eval rollouts (jsonl) to fit on, e.g. the val split's")
    lin.add_argument("score", help="eval rollouts (jsonl) to score on, e.g. the test split's")
    cer = sub.add_parser("certain", help="P(confidence >= 5) on right vs wrong answers")
    cer.add_argument("specs", nargs="+", metavar="LABEL=POLICY=ROLLOUTS", help="a model and its own eval rollouts")
    args = parser.parse_args()
    linear(args.policy, args.fit, args.score) if args.probe == "linear" else certain(args.specs)


if __name__ == "__main__":
    main()
