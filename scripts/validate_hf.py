"""Validate gradtrace on Hugging Face models built from small configs (random weights, nothing downloaded).

Run by hand (needs ``pip install transformers``)::

    python scripts/validate_hf.py            # all models, then the CLI end to end
    python scripts/validate_hf.py gpt2 bert  # only models whose name contains one of the words
    python scripts/validate_hf.py --device cuda  # models and inputs on a GPU (the CLI with --device cuda)

For each model, ``trace()`` is compared with an independent forward and a plain ``loss.backward()`` of
an identical copy, using the checks of ``tests/test_architectures.py``:
(a) every node reachable from the loss (and every node a reentrant checkpoint builds during backward)
is in the trace, (b) every parameter's and input's AccumulateGrad norm equals the plain backward's to
1e-4 relative, (c) every node is attributed to the innermost module that created it (an oracle built
from forward hooks on every module), and the model is left as found. A table is printed; the exit
code is 1 if anything failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests.test_architectures import check_model, to_device  # noqa: E402

VOCAB = 1000
BATCH, SEQ = 2, 12


def ids(seed: int, shape=(BATCH, SEQ)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, shape, generator=generator)


def causal_lm_inputs(with_labels: bool):
    def make():
        kwargs = {"input_ids": ids(1)}
        if with_labels:
            kwargs["labels"] = ids(2)
        return (), kwargs

    return make


class Autocast(torch.nn.Module):
    """Runs the wrapped model under bf16 autocast on its device (paths get the prefix ``model.``)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        with torch.autocast(next(self.parameters()).device.type, dtype=torch.bfloat16):
            return self.model(*args, **kwargs)


def gpt2(gradient_checkpointing: str | None = None, attn_implementation: str = "sdpa", train: bool = True):
    from transformers import GPT2Config, GPT2LMHeadModel

    def build():
        config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64)
        config._attn_implementation = attn_implementation
        model = GPT2LMHeadModel(config).train(train)
        if gradient_checkpointing is not None:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": gradient_checkpointing == "reentrant"}
            )
        return model

    return build


def embeds_inputs():
    """A float input: its gradient must appear as the leaf ``input:inputs_embeds``."""
    generator = torch.Generator().manual_seed(7)
    return (), {"inputs_embeds": torch.randn(BATCH, SEQ, 64, generator=generator), "labels": ids(2)}


def bert_mlm():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64,
    )
    return BertForMaskedLM(config).train()


def bert_model():
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64,
    )
    return BertModel(config).train()


def bert_inputs(with_labels: bool):
    def make():
        kwargs = {"input_ids": ids(3), "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)}
        kwargs["attention_mask"][1, -3:] = 0
        if with_labels:
            labels = ids(4)
            labels[:, ::2] = -100  # only some positions are masked-LM targets
            kwargs["labels"] = labels
        return (), kwargs

    return make


def llama(gradient_checkpointing: str | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    def build():
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )
        model = LlamaForCausalLM(config).train()
        if gradient_checkpointing is not None:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": gradient_checkpointing == "reentrant"}
            )
        return model

    return build


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0,
    )
    return T5ForConditionalGeneration(config).train()


def t5_inputs():
    return (), {"input_ids": ids(5), "labels": ids(6, (BATCH, 7))}


CASES = [
    ("gpt2 (labels)", gpt2(), causal_lm_inputs(True)),
    ("gpt2 (no labels: fallback)", gpt2(), causal_lm_inputs(False)),
    ("gpt2 ckpt reentrant", gpt2("reentrant"), causal_lm_inputs(True)),
    ("gpt2 ckpt non-reentrant", gpt2("non-reentrant"), causal_lm_inputs(True)),
    ("bert-mlm (labels)", bert_mlm, bert_inputs(True)),
    ("bert-model (no labels)", bert_model, bert_inputs(False)),
    ("gpt2 eager attention, eval", gpt2(attn_implementation="eager", train=False), causal_lm_inputs(True)),
    ("gpt2 bf16 autocast", lambda: Autocast(gpt2()()), causal_lm_inputs(True)),
    ("gpt2 inputs_embeds", gpt2(), embeds_inputs),
    ("gpt2 bf16 + ckpt reentrant", lambda: Autocast(gpt2("reentrant")()), causal_lm_inputs(True)),
    ("llama (labels)", llama(), causal_lm_inputs(True)),
    ("llama ckpt reentrant", llama("reentrant"), causal_lm_inputs(True)),
    ("t5 (labels)", t5, t5_inputs),
]


def on_device(build, make_inputs, device: str):
    """``build`` and ``make_inputs`` whose model and inputs are moved to ``device``."""
    return (lambda: build().to(device)), (lambda: to_device(make_inputs(), device))


def run_cli(workdir: Path, device: str = "cpu") -> list[str]:
    """``gradtrace run`` on a GPT-2 model file; returns failures."""
    failures = []
    model_file = workdir / "gpt2_model.py"
    model_file.write_text(textwrap.dedent(f'''
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        def build_model():
            config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size={VOCAB}, n_positions=64,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            return GPT2LMHeadModel(config)

        def example_inputs():
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(0, {VOCAB}, ({BATCH}, {SEQ}), generator=g)
            return {{"input_ids": ids, "labels": ids}}
    '''))
    json_path = workdir / "t.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", NO_COLOR="1")
    commands = {
        "tree": ["gradtrace", "run", str(model_file), "--device", device],
        "json file": ["gradtrace", "run", str(model_file), "--device", device, "--json", str(json_path)],
        "json stdout": ["gradtrace", "run", str(model_file), "--device", device, "--json", "-"],
    }
    outputs = {}
    for label, command in commands.items():
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        outputs[label] = done
        if done.returncode != 0:
            failures.append(f"CLI {label}: exit {done.returncode}: {done.stderr.strip()[-800:]}")
    try:
        document = json.loads(json_path.read_text())
        stdout_document = json.loads(outputs["json stdout"].stdout)
    except (OSError, ValueError) as exc:
        return failures + [f"CLI JSON does not parse: {exc}"]
    if document.get("schema") != "gradtrace/1":
        failures.append(f"CLI JSON schema {document.get('schema')!r}")
    if document["meta"].get("loss_rule") != "output.loss":
        failures.append(f"CLI loss rule {document['meta'].get('loss_rule')!r}, expected 'output.loss'")
    if len(stdout_document["nodes"]) != len(document["nodes"]):
        failures.append("--json - and --json FILE give different node counts")

    # the same model through the API, seeded the way --seed 0 documents
    sys.path.insert(0, str(workdir))
    import gpt2_model  # noqa: E402

    from tracer_cli import trace

    torch.manual_seed(0)
    model = gpt2_model.build_model().to(device)
    api = trace(model, (), to_device(gpt2_model.example_inputs(), device))
    if len(api.nodes) != len(document["nodes"]):
        failures.append(f"CLI JSON has {len(document['nodes'])} nodes, the API trace {len(api.nodes)}")
    cli_leaf = next((n for n in document["nodes"] if n.get("param") == "transformer.wte.weight"), None)
    api_norm = api.leaf("transformer.wte.weight").grad_outputs[0].norm
    if cli_leaf is None:
        failures.append("CLI JSON has no transformer.wte.weight leaf")
    elif abs(cli_leaf["grad_outputs"][0]["norm"] - api_norm) > 1e-4 * abs(api_norm):  # (a GPU's sums may differ)
        failures.append(f"CLI wte.weight norm {cli_leaf['grad_outputs'][0]['norm']} != API {api_norm}")
    if not all(n["order"] is not None for n in document["nodes"]):
        failures.append("CLI JSON has nodes that never ran")
    if "transformer.h.0.attn.c_attn" not in outputs["tree"].stdout:
        failures.append("the CLI tree does not mention module transformer.h.0.attn.c_attn")
    print(f"CLI: gradtrace run gpt2_model.py --json t.json -> {len(document['nodes'])} nodes, "
          f"loss {document['meta']['loss']:.4f} ({document['meta']['loss_rule']}), "
          f"tree {len(outputs['tree'].stdout.splitlines())} lines")
    return failures


def main(argv: list[str]) -> int:
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: pip install transformers", file=sys.stderr)
        return 2
    device = "cpu"
    if "--device" in argv:
        at = argv.index("--device")
        device, argv = argv[at + 1], argv[:at] + argv[at + 2 :]
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    chosen = [c for c in CASES if not argv or any(word in c[0] for word in argv)]
    reports = []
    for name, build, make_inputs in chosen:
        try:
            report = check_model(name, *on_device(build, make_inputs, device), timing_repeats=3)
        except Exception as exc:  # a crash is a failure of that row, not of the script
            from tests.test_architectures import Report

            report = Report(name, failures=[f"raised {type(exc).__name__}: {exc}"])
        reports.append(report)

    header = f"{'model':30} {'traced':>7} {'ran':>6} {'ref':>6} {'max rel err':>11} {'attr fail':>9} {'other fail':>10} {'trace/plain':>11}  loss rule"
    print(header)
    print("-" * len(header))
    for r in reports:
        ratio = r.trace_s / r.plain_s if r.plain_s else float("nan")
        print(f"{r.name:30} {r.nodes_traced:7} {r.nodes_executed:6} {r.nodes_reference:6} {r.max_rel_err:11.1e} "
              f"{len(r.attribution_failures):9} {len(r.failures):10} {ratio:10.2f}x  {r.loss_rule}")
    failed = False
    for r in reports:
        for failure in r.all_failures()[:20]:
            failed = True
            print(f"FAIL {r.name}: {failure}")
        if len(r.all_failures()) > 20:
            print(f"FAIL {r.name}: ... {len(r.all_failures()) - 20} more")

    if not argv or "cli" in argv:
        with tempfile.TemporaryDirectory() as tmp:
            for failure in run_cli(Path(tmp), device):
                failed = True
                print(f"FAIL cli: {failure}")
    print("FAILED" if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
