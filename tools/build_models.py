"""Rebuild the bundled checkpoints in models/ deterministically (CPU, fixed seeds):

  models/tiny-adder     LlamaForCausalLM policy, character-level tokenizer, warm-started by
                        supervised training on the built-in addition task in two phases: correct
                        sums (1,500 steps), then demonstrations that forget each carry 70% of the
                        time (1,000 steps; 57+68=15), so the right answer keeps real probability
                        but is no longer the greedy choice.
  models/tiny-adder-rm  LlamaForSequenceClassification (num_labels=1), same tokenizer, initialised
                        from the policy (the SFT model, as InstructGPT does) and trained with a
                        Bradley-Terry loss on (correct, wrong) pairs whose wrong answers are
                        varied (dropped carries, any digit off, random numbers, a digit added or
                        cut): a good but imperfect proxy for correctness. A reward model trained
                        only on dropped-carry and one-digit mistakes was hacked by PPO within 20
                        steps (answers like 55+43=107 scored above the truth), so negatives must
                        cover what a drifting policy writes.

Neither ever sees the held-out eval pairs (common.task_eval_pairs).
Run: python tools/build_models.py (RM_ONLY=1 retrains only the reward model from the saved policy)
(measured 2026-11-29, 2-core CPU: about 7 minutes, of which the reward model 76 s; policy held-out
greedy accuracy 0.288; reward model held-out pair agreement 0.862 on correct vs dropped-carry /
one-digit-off answers).
"""
import os
import random
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, processors
from transformers import (LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification,
                          PreTrainedTokenizerFast)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

DROP = 0.7  # probability that a demonstration forgets a carry
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def column_sum(a, b, rng=None, drop=0.0):
    """a + b by column addition. Each carry is forgotten with probability `drop`: the warm-start
    data's human-like error (37+48 -> 75, 57+68 -> 15, not 85 and 125). drop=0 gives the true
    sum."""
    da, db = str(a)[::-1], str(b)[::-1]
    n, out, carry = max(len(da), len(db)), 0, 0
    for i in range(n):
        s = int(da[i] if i < len(da) else 0) + int(db[i] if i < len(db) else 0) + carry
        out, carry = out + (s % 10) * 10**i, s // 10
        if carry and rng is not None and rng.random() < drop:
            carry = 0
    return out + carry * 10**n


def build_tokenizer():
    """Character level over printable ASCII: a BPE with no merges is exactly one token per
    character."""
    vocab = {t: i for i, t in enumerate(SPECIALS + [chr(c) for c in range(32, 127)])}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                      special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", padding_side="left",
                                   model_max_length=64)


def config(tok, **kw):
    return LlamaConfig(vocab_size=len(tok), max_position_embeddings=64, tie_word_embeddings=True,
                       pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id, num_attention_heads=4,
                       num_key_value_heads=4, **kw)


def batch(tok, rng, pairs, answers):
    """Left-padded prompt+answer+EOS; labels only on the answer and the EOS."""
    seqs, labels = [], []
    for (a, b), ans in zip(pairs, answers):
        p = tok(f"{a}+{b}=")["input_ids"]
        c = tok(str(ans), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + c)
        labels.append([-100] * len(p) + c)
    ids, mask = common.left_pad(seqs, tok.pad_token_id, "cpu")
    lab = torch.tensor([[-100] * (ids.shape[1] - len(row)) + row for row in labels])
    return ids, mask, lab


def train_policy(tok, steps, drop, model=None, bs=128, lr=2e-3):
    """Supervised training on prompt -> column_sum(drop) + EOS, loss on the answer and the EOS
    only."""
    torch.manual_seed(0)
    rng = random.Random(int(drop * 100))
    model = model or LlamaForCausalLM(config(tok, hidden_size=160, num_hidden_layers=3,
                                             intermediate_size=480))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.05)
    for step in range(steps):
        pairs = common.task_train_pairs(rng, bs)
        ids, mask, lab = batch(tok, rng, pairs, [column_sum(a, b, rng, drop) for a, b in pairs])
        loss = model(input_ids=ids, attention_mask=mask, position_ids=common.positions(mask),
                     labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        if step % 500 == 0 or step == steps - 1:
            print(f"policy (drop={drop}) step {step} loss {loss.item():.3f} held-out greedy "
                  f"accuracy {held_out_accuracy(model, tok):.3f}", flush=True)
    return model


def held_out_accuracy(model, tok):
    args = SimpleNamespace(chat_template="none", max_new_tokens=6, stop=())
    rows = [common.addition_row(a, b) for a, b in common.task_eval_pairs()]
    return common.evaluate(model, tok, rows, args, torch.autocast("cpu", enabled=False))


def wrong_answer(a, b, rng):
    """A plausible mistake: a forgotten carry when there is one, else one digit nudged."""
    s, bad = a + b, column_sum(a, b, rng, 1.0)
    if bad != s and rng.random() < 0.6:
        return bad
    d = list(str(s))
    i = rng.randrange(len(d))
    d[i] = str((int(d[i]) + rng.choice([1, 9])) % 10)
    return int("".join(d))


def negative(a, b, rng):
    """A wrong answer for RM training: the policy's own kind of mistake, and the kinds a drifting
    policy makes."""
    s, u = a + b, rng.random()
    if u < 0.35:
        return str(wrong_answer(a, b, rng))
    if u < 0.55:  # any digit off by 1..9
        d = list(str(s))
        i = rng.randrange(len(d))
        d[i] = str((int(d[i]) + rng.randrange(1, 10)) % 10)
        return str(int("".join(d))) if "".join(d) != str(s) else str(s + 1)
    if u < 0.70:  # a random number
        r = rng.randrange(200)
        return str(r if r != s else r + 1)
    if u < 0.82:  # a digit too many
        return str(s) + str(rng.randrange(10))
    if u < 0.92:  # a digit too few
        return str(s)[:-1]
    return str(s + rng.choice([-10, 10, 100, -100] if s >= 100 else [-10, 10, 100]))


def train_reward_model(tok, steps, policy, bs=64, lr=5e-4):
    torch.manual_seed(1)
    rng = random.Random(1)
    rm = LlamaForSequenceClassification(config(tok, hidden_size=160, num_hidden_layers=3,
                                               intermediate_size=480, num_labels=1))
    # start from the SFT model: it already adds (InstructGPT)
    rm.model.load_state_dict(policy.model.state_dict())
    # a fresh score head, N(0, 1/sqrt(d+1)) (N details)
    torch.nn.init.normal_(rm.score.weight, std=1 / (rm.config.hidden_size + 1) ** 0.5)
    opt = torch.optim.AdamW(rm.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.05)
    for step in range(steps):
        pairs = common.task_train_pairs(rng, bs)
        good = [f"{a}+{b}={a + b}" for a, b in pairs]
        bad = [f"{a}+{b}={negative(a, b, rng)}" for a, b in pairs]
        r = score_with_grad(rm, tok, good + bad)
        # Bradley-Terry: P(good > bad) = sigmoid(r_good - r_bad)
        loss = -F.logsigmoid(r[:bs] - r[bs:]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if step % 200 == 0:
            print(f"reward model step {step} loss {loss.item():.3f}", flush=True)
    return rm


def score_with_grad(rm, tok, texts):
    seqs = [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]
    ids, mask = common.left_pad(seqs, tok.pad_token_id, "cpu")
    pos = common.positions(mask)
    hidden = rm.base_model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    return rm.score(hidden[:, -1])[:, 0]


def main():
    t0 = time.time()
    clean_steps = int(os.environ.get("CLEAN_STEPS", 1500))
    sloppy_steps = int(os.environ.get("SLOPPY_STEPS", 1000))
    rm_steps = int(os.environ.get("RM_STEPS", 600))
    tok = build_tokenizer()
    if os.environ.get("RM_ONLY"):
        # the policy build is deterministic: reuse the saved one, retrain only the RM
        policy = LlamaForCausalLM.from_pretrained(common.DEFAULT_POLICY)
    else:
        # two phases: learn correct addition, then fine-tune on sloppy demonstrations
        # that forget carries
        policy = train_policy(tok, clean_steps, drop=0.0)
        policy = train_policy(tok, sloppy_steps, drop=DROP, model=policy, lr=1e-3)
        policy.generation_config.pad_token_id = tok.pad_token_id
        policy.save_pretrained(common.DEFAULT_POLICY, safe_serialization=True)
        tok.save_pretrained(common.DEFAULT_POLICY)
    rm = train_reward_model(tok, rm_steps, policy)
    rm.save_pretrained(common.DEFAULT_REWARD_MODEL, safe_serialization=True)
    tok.save_pretrained(common.DEFAULT_REWARD_MODEL)
    # report: held-out greedy accuracy of the policy, held-out pair agreement of the reward model
    acc = held_out_accuracy(policy, tok)
    rng = random.Random(2)
    pairs = common.task_eval_pairs()
    prompts = [f"{a}+{b}=" for a, b in pairs]
    with torch.no_grad():
        good = common.rm_scores(rm, tok, prompts, [str(a + b) for a, b in pairs])
        bad = common.rm_scores(rm, tok, prompts, [str(wrong_answer(a, b, rng)) for a, b in pairs])
    n_policy = sum(p.numel() for p in policy.parameters())
    print(f"policy params {n_policy}, held-out greedy accuracy {acc:.3f}")
    n_rm = sum(p.numel() for p in rm.parameters())
    print(f"reward model params {n_rm}, held-out pair agreement {(good > bad).float().mean():.3f}")
    print(f"rebuild time {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
