"""One peer training run for bench_pelt_core.py: PEFT or AdapterHub `adapters`, as their quick starts do.

Runs in whichever venv holds the peer library (the project venv for peft, benchmarks/.venv-adapters for
`adapters`, which pins an older transformers) and imports nothing from pelt_core. It reads the K-shot
training rows and the dev rows that the main script wrote as JSON Lines, trains, evaluates once at the end,
and prints one JSON object on the last line of stdout.

- peft: PEFT's sequence-classification example notebook (examples/sequence_classification/LoRA.ipynb;
  its prefix-tuning notebook no longer runs on transformers 5, so prefix tuning's peer is AdapterHub's):
  AutoModelForSequenceClassification + get_peft_model, tokenised without padding,
  DataLoader(shuffle=True) with `tokenizer.pad(padding="longest")`, torch AdamW, linear schedule with 6%
  warmup, a plain torch loop in fp32 (on `--device`, by default the CPU; `--max-steps` ends it early). LoRA
  targets the attention's query and value maps of BERT (query, value) and Llama (q_proj, v_proj) models.
- adapters: AdapterHub's quick start (notebooks/01_Adapter_Training.ipynb): AutoAdapterModel, add_adapter,
  add_classification_head, train_adapter, AdapterTrainer with TrainingArguments, inputs tokenised with
  padding="max_length" (the notebook pads every row to max_length).

Tokens are counted the same way as pelt counts them: the non-padding tokens (attention_mask sum) of every
training batch; padded positions processed are counted separately.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tokenize(tokenizer, rows: list[dict], fields: list[str], max_length: int, padding) -> list[dict]:
    columns = [[str(r[f]) for r in rows] for f in fields]
    enc = tokenizer(*columns, truncation=True, max_length=max_length, padding=padding)
    out = []
    for i, row in enumerate(rows):
        item = {k: enc[k][i] for k in enc}
        item["labels"] = int(row["label"])
        out.append(item)
    return out


class Counter:
    """Counts real (attention_mask) and padded tokens of the batches it collates while `active`."""

    def __init__(self, collate):
        self.collate = collate
        self.active = True
        self.tokens = 0
        self.padded = 0
        self.examples = 0

    def __call__(self, features):
        batch = self.collate(features)
        if self.active:
            mask = batch["attention_mask"]
            self.tokens += int(mask.sum())
            self.padded += int(mask.numel())
            self.examples += int(mask.shape[0])
        return batch


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float((logits.argmax(-1) == labels).mean())


# the attention's query and value maps, as PEFT's examples target them, by model family
LORA_TARGETS = {"bert": ["query", "value"], "llama": ["q_proj", "v_proj"]}


def run_peft(args, path, tokenizer, train_rows, dev_rows) -> dict:
    from peft import LoraConfig, get_peft_model
    from torch.utils.data import DataLoader
    from transformers import AutoConfig, AutoModelForSequenceClassification, get_linear_schedule_with_warmup

    if args.method == "lora":
        model_type = AutoConfig.from_pretrained(path).model_type
        targets = LORA_TARGETS["llama" if model_type in ("llama", "mistral", "qwen2") else "bert"]
        config = LoraConfig(task_type="SEQ_CLS", r=8, lora_alpha=8, lora_dropout=0.0, target_modules=targets)
    elif args.method == "prefix":  # PEFT's forward refuses: the encoder takes no past key values any more
        raise SystemExit(
            "PEFT's prefix tuning does not run for sequence classification on transformers 5 (\"Model does "
            'not support past key values which are required for prefix tuning"): use --lib adapters'
        )
    else:
        raise SystemExit(f"peft peer has no method {args.method!r}")
    torch.manual_seed(args.seed)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    if model.config.pad_token_id is None:  # a decoder finds each row's last token by its pad id
        model.config.pad_token_id = tokenizer.pad_token_id
    device = torch.device(args.device)
    model = get_peft_model(model, config).to(device)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    train_set = tokenize(tokenizer, train_rows, args.fields, args.max_length, padding=False)
    dev_set = tokenize(tokenizer, dev_rows, args.fields, args.max_length, padding=False)
    counter = Counter(lambda ex: tokenizer.pad(ex, padding="longest", return_tensors="pt"))
    generator = torch.Generator().manual_seed(args.seed)
    train_loader = DataLoader(
        train_set, shuffle=True, collate_fn=counter, batch_size=args.batch_size, generator=generator
    )
    dev_loader = DataLoader(dev_set, shuffle=False, collate_fn=counter, batch_size=args.eval_batch_size)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = args.max_steps or len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total), total)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)

    model.train()
    steps = 0
    started = time.perf_counter()
    while steps < total and len(train_loader):  # `epochs` passes over the data, or `max_steps` steps
        for batch in train_loader:
            with autocast:
                loss = model(**batch.to(device)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            steps += 1
            if steps == total:
                break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    train_seconds = time.perf_counter() - started

    counter.active = False
    model.eval()
    logits, labels = [], []
    with torch.no_grad():
        for batch in dev_loader:
            gold = batch.pop("labels")
            with autocast:
                logits.append(model(**batch.to(device)).logits.float().cpu().numpy())
            labels.append(gold.numpy())
    metric = accuracy(np.concatenate(logits), np.concatenate(labels))
    return {
        "steps": steps,
        "train_seconds": train_seconds,
        "tokens": counter.tokens,
        "padded_tokens": counter.padded,
        "examples": counter.examples,
        "accuracy": metric,
        "trainable": trainable,
    }


def adapters_config(method: str, stock: bool):
    """AdapterHub configs; by default sized like pelt's presets on a 384-wide model (see README)."""
    from adapters import (
        LoRAConfig,
        MAMConfig,
        ParBnConfig,
        PrefixTuningConfig,
        SeqBnConfig,
        UniPELTConfig,
    )

    if stock:
        return {"prefix": "prefix_tuning", "pfeiffer": "seq_bn", "unipelt": "unipelt", "mam": "mam"}[method]
    if method == "prefix":  # pelt: prefix l=10, reparametrised through an MLP of 512
        return PrefixTuningConfig(prefix_length=10, bottleneck_size=512)
    if method == "pfeiffer":  # pelt: size 48 after the FFN -> reduction 384/48 = 8
        return SeqBnConfig(reduction_factor=8)
    if method == "unipelt":  # pelt: gated adapter 48, prefix l=10 (MLP 512), LoRA q/v r=8 alpha=16
        return UniPELTConfig(
            PrefixTuningConfig(prefix_length=10, bottleneck_size=512, use_gating=True),
            SeqBnConfig(reduction_factor=8, use_gating=True),
            LoRAConfig(r=8, alpha=16, use_gating=True),
        )
    if method == "mam":  # pelt: prefix l=30 (MLP 512) + parallel FFN adapter 512, scale 4
        return MAMConfig(
            PrefixTuningConfig(prefix_length=30, bottleneck_size=512),
            ParBnConfig(reduction_factor=384 / 512, scaling=4.0),
        )
    raise SystemExit(f"adapters peer has no method {method!r}")


def run_adapters(args, path, tokenizer, train_rows, dev_rows) -> dict:
    import tempfile

    from adapters import AdapterTrainer, AutoAdapterModel
    from transformers import DataCollatorWithPadding, TrainingArguments, default_data_collator

    torch.manual_seed(args.seed)
    model = AutoAdapterModel.from_pretrained(path)
    model.add_adapter("bench", config=adapters_config(args.method, args.stock_configs))
    model.add_classification_head("bench", num_labels=2)
    model.train_adapter("bench")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    padding = "max_length" if args.padding == "max_length" else False
    train_set = tokenize(tokenizer, train_rows, args.fields, args.max_length, padding=padding)
    dev_set = tokenize(tokenizer, dev_rows, args.fields, args.max_length, padding=padding)
    base = default_data_collator if padding == "max_length" else DataCollatorWithPadding(tokenizer)
    counter = Counter(base)

    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out,
            learning_rate=args.lr,
            num_train_epochs=args.epochs,
            per_device_train_batch_size=args.batch_size,
            per_device_eval_batch_size=args.eval_batch_size,
            warmup_ratio=args.warmup_ratio,
            weight_decay=0.0,
            max_grad_norm=1.0,
            seed=args.seed,
            eval_strategy="no",
            save_strategy="no",
            logging_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=args.bf16,
            remove_unused_columns=False,
            disable_tqdm=True,
        )
        trainer = AdapterTrainer(
            model=model, args=training_args, train_dataset=train_set, data_collator=counter
        )
        result = trainer.train()
        counter.active = False
        prediction = trainer.predict(dev_set)
    logits = (
        prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    )
    metric = accuracy(np.asarray(logits), np.asarray([r["labels"] for r in dev_set]))
    return {
        "steps": int(result.global_step),
        "train_seconds": float(result.metrics["train_runtime"]),
        "tokens": counter.tokens,
        "padded_tokens": counter.padded,
        "examples": counter.examples,
        "accuracy": metric,
        "trainable": trainable,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", choices=("peft", "adapters"), required=True)
    parser.add_argument("--method", required=True, help="pelt method name this peer stands in for")
    parser.add_argument("--model", required=True, help="model folder")
    parser.add_argument("--train", required=True)
    parser.add_argument("--dev", required=True)
    parser.add_argument("--fields", required=True, help="comma-separated text fields")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--warmup-ratio", type=float, default=0.06)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument(
        "--padding",
        choices=("max_length", "longest"),
        default="max_length",
        help="adapters only: the quick start pads to max_length; 'longest' pads per batch",
    )
    parser.add_argument(
        "--stock-configs",
        action="store_true",
        help="adapters only: the stock 'seq_bn'/'unipelt'/'mam' strings instead of pelt-sized ones",
    )
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (the quick starts train in fp32)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="peft only: where to train (cpu, cuda, cuda:N)")
    parser.add_argument("--max-steps", type=int, default=0, help="peft only: stop after N steps (0: epochs)")
    args = parser.parse_args()
    args.fields = args.fields.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.pad_token is None:  # decoders such as Llama ship without one
        tokenizer.pad_token = tokenizer.eos_token
    train_rows, dev_rows = read_jsonl(args.train), read_jsonl(args.dev)
    run = run_peft if args.lib == "peft" else run_adapters
    result = run(args, args.model, tokenizer, train_rows, dev_rows)
    import transformers

    version = __import__(args.lib).__version__
    result.update(
        {
            "lib": args.lib,
            "lib_version": version,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "lr": args.lr,
            "bf16": args.bf16,
            "padding": "longest" if args.lib == "peft" else args.padding,
        }
    )
    sys.stdout.flush()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
