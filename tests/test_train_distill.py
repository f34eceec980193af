"""Distillation (CE + weight·T²·KL to the source model) and attention-only training through `mla train`
(tiny MLA model converted from the tiny Llama, which is the teacher; CPU, gloo):

- the chunked KL equals the KL written directly, value and gradient, masking and normalisation included;
- weight 0 gives today's metrics.csv exactly and never reads the teacher;
- ZeRO 0/1/2 (1 process) and ZeRO-3 (2 processes) train to the plain PyTorch loop's CE and KL (1e-4), the teacher
  whole on every rank; metrics.csv and MLflow carry ce (as `loss`), kl and the total;
- --trainable attention (ZeRO-2, weight decay on): every non-attention parameter bit-identical, the optimizer
  state only as large as the attention parameters;
- bad input stops in one line before any work.
"""

from __future__ import annotations

import json

import pytest
import torch
from train_helpers import (  # noqa: F401
    loaded_shares,
    plain_losses,
    read_rows,
    run_train,
    train_inputs,
)

from mla.cli import main

STEPS, LR, WARMUP, DECAY, MICRO = 6, 3e-3, 2, 2, 2
WEIGHT, T = 0.5, 2.0
RECIPE = ["--steps", str(STEPS), "--lr", str(LR), "--warmup-steps", str(WARMUP), "--decay-steps", str(DECAY),
          "--micro-batch", str(MICRO), "--global-batch", "4", "--save-steps", str(STEPS), "--clip", "1.0"]


def distill_flags(root, weight=WEIGHT, temperature=T):
    return ["--distill-weight", str(weight), "--distill-temperature", str(temperature), "--teacher", str(root / "llama")]


def column(rows, name):
    return [float(r[name]) for r in rows]


def max_diff(a, b) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


# ---------------------------------------------------------------- the KL itself
def _direct_kl(student, teacher, labels, t, count=None):
    """KL(p_T ‖ q_T) per predicted token, written directly with torch's kl_div on the shifted, masked tokens."""
    keep = labels[:, 1:] != -100
    s, p = student[:, :-1][keep].float() / t, teacher[:, :-1][keep].float() / t
    total = torch.nn.functional.kl_div(torch.log_softmax(s, -1), torch.log_softmax(p, -1), log_target=True,
                                       reduction="sum")
    return total / (keep.sum() if count is None else count)


@pytest.mark.parametrize("chunk_elements", [2**22, 3 * 50])  # one chunk; 3 rows a chunk with a remainder
def test_chunked_kl_equals_the_direct_formula(monkeypatch, chunk_elements):
    from mla.training import distill, kl_chunks

    monkeypatch.setattr(kl_chunks, "KL_CHUNK_ELEMENTS", chunk_elements)
    g = torch.Generator().manual_seed(0)
    student = torch.randn(3, 7, 50, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(3, 7, 50, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 50, (3, 7), generator=g)
    labels[0, 3] = labels[2, 1] = -100
    for t, count in ((1.0, None), (2.5, None), (1.0, torch.tensor(40))):
        ours = distill.token_kl(student, teacher, labels, t, count)
        direct = _direct_kl(student, teacher, labels, t, count)
        assert ours.item() == pytest.approx(direct.item(), rel=1e-6), (t, count)
        (g_ours,) = torch.autograd.grad(ours, student)
        (g_direct,) = torch.autograd.grad(direct, student)
        assert torch.allclose(g_ours.double(), g_direct, atol=1e-7), (t, count)
        assert g_ours[:, -1].abs().max() == 0 and g_ours[0, 2].abs().max() == 0  # untargeted positions
    # the chunks run in fp32 whatever the logits' dtype
    assert distill.token_kl(student.bfloat16(), teacher.bfloat16(), labels, 1.0).dtype == torch.float32
    assert distill.token_kl(teacher, teacher, labels, 1.0).item() == pytest.approx(0, abs=1e-6)


def test_kl_chunks_bound_the_fp32_temporaries():
    from mla.training.kl_chunks import KL_CHUNK_ELEMENTS, chunk_rows

    assert chunk_rows(32000) * 32000 <= KL_CHUNK_ELEMENTS < (chunk_rows(32000) + 1) * 32000
    assert chunk_rows(10**9) == 1


# ---------------------------------------------------------------- weight 0 is today's run
@pytest.mark.timeout(400)
def test_weight_zero_gives_todays_losses_exactly_and_never_reads_the_teacher(train_inputs, tmp_path):
    root = train_inputs
    today = run_train(root, "w0-none", *RECIPE, "--no-mlflow")
    assert today.returncode == 0, today.stderr[-3000:]
    zero = run_train(root, "w0-zero", *RECIPE, "--no-mlflow", "--distill-weight", "0", "--distill-temperature", "3",
                     "--teacher", str(tmp_path / "no-such-teacher"))
    assert zero.returncode == 0, zero.stderr[-3000:]
    assert "teacher" not in zero.stderr
    a, b = read_rows(root / "w0-none" / "metrics.csv"), read_rows(root / "w0-zero" / "metrics.csv")
    assert list(a[0]) == list(b[0]) == ["step", "loss", "lr", "grad_norm", "tokens", "tokens_per_second"]
    assert [(r["loss"], r["grad_norm"], r["lr"]) for r in a] == [(r["loss"], r["grad_norm"], r["lr"]) for r in b]
    assert json.loads((root / "w0-zero" / "run.json").read_text())["distill"] is None


# ---------------------------------------------------------------- distillation under every ZeRO stage
@pytest.fixture(scope="module")
def reference(train_inputs):
    """The plain loop's (ce, kl) per step with the teacher."""
    pairs = plain_losses(train_inputs, STEPS, 4, LR, WARMUP, DECAY, distill=(train_inputs / "llama", WEIGHT, T))
    return [c for c, _ in pairs], [k for _, k in pairs]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_distillation_one_process_matches_the_plain_loop(train_inputs, reference, stage):
    from mlflow.tracking import MlflowClient

    root, out = train_inputs, f"distill-z{stage}"
    proc = run_train(root, out, *RECIPE, "--zero-stage", str(stage), *distill_flags(root), "--run-name", out,
                     "--experiment", "distill")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ce, kl = reference
    assert kl[0] > 1e-3 and ce[-1] < ce[0] - 0.05   # the KL is not trivially zero, the run learns
    rows = read_rows(root / out / "metrics.csv")
    assert list(rows[0]) == ["step", "loss", "lr", "grad_norm", "tokens", "tokens_per_second", "kl", "total_loss"]
    assert max_diff(column(rows, "loss"), ce) <= 1e-4, (column(rows, "loss"), ce)   # `loss` is the CE
    assert max_diff(column(rows, "kl"), kl) <= 1e-4, (column(rows, "kl"), kl)
    total = [c + WEIGHT * T * T * k for c, k in zip(column(rows, "loss"), column(rows, "kl"))]
    assert max_diff(column(rows, "total_loss"), total) <= 1e-5

    info = json.loads((root / out / "run.json").read_text())
    assert info["distill"] == {"weight": WEIGHT, "temperature": T, "teacher": str(root / "llama")}
    client = MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    run = client.get_run(info["mlflow_run_id"])
    for key in ("loss", "kl", "total_loss"):
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert history == pytest.approx(dict(enumerate(column(rows, key), 1)), abs=1e-9), key
    assert (run.data.params["distill_weight"], run.data.params["distill_temperature"]) == (str(WEIGHT), str(T))


@pytest.mark.timeout(500)
def test_distillation_under_zero3_on_two_ranks_keeps_the_teacher_whole(train_inputs, reference):
    from mla.checkpoint import load_model

    root = train_inputs
    proc = run_train(root, "distill-z3", *RECIPE, "--zero-stage", "3", "--nproc", "2", *distill_flags(root),
                     "--no-mlflow")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    student = loaded_shares(proc.stderr)
    assert sorted(student) == [0, 1] and all(local == 0 for _, _, local, _, _ in student.values())  # partitioned
    teacher_elements = sum(p.numel() for p in load_model(root / "llama").parameters())
    lines = [line for line in proc.stderr.splitlines() if "holds the teacher" in line]
    assert len(lines) == 2, proc.stderr[-3000:]
    for line in lines:
        assert f"{teacher_elements:,} parameter elements in local tensors, 0 parameters partitioned" in line, line
    rows = read_rows(root / "distill-z3" / "metrics.csv")
    ce, kl = reference
    assert max_diff(column(rows, "loss"), ce) <= 1e-4
    assert max_diff(column(rows, "kl"), kl) <= 1e-4


# ---------------------------------------------------------------- attention only
@pytest.mark.timeout(400)
def test_attention_only_training_leaves_every_other_parameter_bit_identical(train_inputs):
    from mla.checkpoint import load_model

    root, wd = train_inputs, 0.1
    proc = run_train(root, "attention", *RECIPE, "--zero-stage", "2", "--weight-decay", str(wd), "--trainable",
                     "attention", *distill_flags(root, 1.0, 1.0), "--no-mlflow")
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = dict(load_model(root / "mla").named_parameters())
    after = dict(load_model(root / "attention" / "final").named_parameters())
    attention = {n for n in before if ".self_attn." in n}
    assert attention and len(attention) < len(before)
    for name, p in before.items():
        if name in attention:
            assert not torch.equal(p, after[name]), f"{name} did not train"
        else:
            assert torch.equal(p, after[name]), f"{name} changed"
    # the optimizer holds fp32 master weights (and Adam moments) for the attention parameters only
    n_attention = sum(before[n].numel() for n in attention)
    optim = root / "attention.checkpoints" / f"checkpoint-{STEPS}" / f"global_step{STEPS}" / \
        "mp_rank_00_optim_states.pt"
    if not optim.is_file():
        optim = optim.with_name("zero_pp_rank_0_mp_rank_00_optim_states.pt")
    state = torch.load(optim, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    held = sum(t.numel() for t in state["single_partition_of_fp32_groups"])
    assert n_attention <= held <= n_attention + 64, (held, n_attention)
    info = json.loads((root / "attention" / "run.json").read_text())["trainable"]
    assert info == {"mode": "attention", "parameters": sum(p.numel() for p in before.values()),
                    "trainable_parameters": n_attention}
    # and the losses are the plain loop's with the same parameters frozen
    pairs = plain_losses(root, STEPS, 4, LR, WARMUP, DECAY, weight_decay=wd, distill=(root / "llama", 1.0, 1.0),
                         trainable="attention")
    assert max_diff(column(read_rows(root / "attention" / "metrics.csv"), "loss"), [c for c, _ in pairs]) <= 1e-4


# ---------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """Teachers the tiny student cannot learn from: another vocabulary size; the same size, other tokens."""
    from mla.tiny_models import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("teachers")
    save_tiny_checkpoint(root / "other", vocab_size=256)
    save_tiny_checkpoint(root / "retokenized")
    doc = json.loads((root / "retokenized" / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[1:3]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (root / "retokenized" / "tokenizer.json").write_text(json.dumps(doc))
    return root


@pytest.mark.parametrize("flags,message", [
    (["--distill-weight", "-1", "--teacher", "{llama}"],
     "--distill-weight (train.distill.weight) must be >= 0, got -1.0"),
    (["--distill-weight", "1", "--distill-temperature", "0", "--teacher", "{llama}"],
     "--distill-temperature (train.distill.temperature) must be > 0, got 0.0"),
    (["--distill-weight", "1"], "--distill-weight 1.0 needs --teacher DIR"),
    (["--trainable", "mlp"], "--trainable (train.trainable) must be one of all, attention, got 'mlp'"),
    (["--distill-weight", "1", "--teacher", "{missing}"], "--teacher {missing}: missing checkpoint"),
    (["--distill-weight", "1", "--teacher", "{other}"],
     "--teacher {other}: its vocabulary has 256 tokens, the student's 512"),
    (["--distill-weight", "1", "--teacher", "{retokenized}"],
     "--teacher {retokenized}: its tokenizer.json maps other tokens than the student's"),
])
def test_bad_distillation_input_fails_in_one_line_before_any_work(train_inputs, teachers, tmp_path, capsys, flags,
                                                                  message):
    paths = {"llama": train_inputs / "llama", "missing": teachers / "missing", "other": teachers / "other",
             "retokenized": teachers / "retokenized"}
    flags = [f.format(**paths) for f in flags]
    capsys.readouterr()
    rc = main(["train", "--model", str(train_inputs / "mla"), "--data", str(train_inputs / "data"),
               "--out", str(tmp_path / "run"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert message.format(**paths) in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_train_help_lists_the_distillation_and_trainable_options(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for flag in ("--distill-weight", "--distill-temperature", "--teacher DIR", "--trainable"):
        assert flag in text, flag
