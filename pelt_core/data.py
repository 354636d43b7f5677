"""User datasets: JSON Lines, CSV, Parquet or a `datasets` folder; field detection; K-shot sampling;
tokenisation once, then dynamic padding over length-grouped batches."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pelt_core.errors import DataError
from pelt_core.json_nesting import json_depth, too_deep_line
from pelt_core.labels import ProblemTypeError, class_names, infer_problem_type, label_index
from pelt_core.limits import MAX_DATASET_BYTES, MAX_JSON_ROW_DEPTH, dev_split_rows
from pelt_core.parquet_size import WORKER_BATCH_BYTES, DecodedSizeError, check_parquet_decoded_size
from pelt_core.saved_dataset import SavedDatasetError, load_saved_dataset
from pelt_core.vocabulary import LABEL_FIELD_CANDIDATES, find_text_fields


def load_table(path: str | Path, split: str | None = None, *, max_decoded_bytes: int = MAX_DATASET_BYTES):
    """Read a JSON Lines, JSON, CSV or Parquet file, or a `datasets` folder (save_to_disk), as a Dataset.

    A folder is checked first (`pelt_core.saved_dataset`): it may only name its own Arrow files, and its
    tables are built from them with their checked features. JSON rows may nest at most
    `limits.MAX_JSON_ROW_DEPTH` deep (pyarrow's reader crashes on deeper ones). A Parquet file is read
    in bounded batches first and refused when it decodes to more than `max_decoded_bytes`
    (PELT_MAX_DATASET_BYTES; a repeated text counts once per row: `pelt_core.parquet_size`)."""
    import datasets

    datasets.disable_progress_bars()
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{path}: no such file or folder")
    try:
        if p.is_dir():
            try:
                loaded = load_saved_dataset(p)
            except SavedDatasetError as exc:
                raise DataError(f"{path}: {exc}") from None
            if isinstance(loaded, datasets.DatasetDict):
                if split is None:
                    raise DataError(
                        f"{path}: a DatasetDict with splits {', '.join(loaded)}; name one (e.g. {path}:train)"
                    )
                if split not in loaded:
                    raise DataError(f"{path}: no split {split!r}; it has {', '.join(loaded)}")
                return loaded[split]
            return loaded
        suffix = "".join(p.suffixes[-2:]) if p.suffix == ".gz" else p.suffix
        if suffix in (".jsonl", ".json", ".jsonl.gz", ".json.gz"):
            _check_json_nesting(p, suffix)
            return datasets.Dataset.from_json(str(p))
        if suffix in (".csv", ".csv.gz"):
            return datasets.Dataset.from_csv(str(p))
        if suffix in (".tsv",):
            return datasets.Dataset.from_csv(str(p), sep="\t")
        if suffix == ".parquet":
            _check_parquet(p, max_decoded_bytes)
            return datasets.Dataset.from_parquet(str(p))
    except DataError:
        raise
    except (ImportError, AttributeError, RuntimeError, MemoryError):
        raise  # not the file's fault (an import, a bug, memory): no DataError, which would end the job for good
    except Exception as exc:  # the readers raise many types; the user needs the file and the reason
        raise DataError(f"{path}: cannot read it as {p.suffix or 'a datasets folder'}: {exc}") from exc
    raise DataError(
        f"{path}: unsupported file type {p.suffix!r}; use .jsonl, .json, .csv, .tsv, .parquet "
        "or a datasets folder"
    )


def _check_parquet(path: Path, max_decoded_bytes: int) -> None:
    """A Parquet file decoding past `max_decoded_bytes` is a DataError naming it (checked once per version
    of a file: a worker loads a task's data for every job)."""
    status = path.stat()
    try:
        _parquet_decoded_bytes(str(path.resolve()), status.st_size, status.st_mtime_ns, max_decoded_bytes)
    except DecodedSizeError as exc:
        raise DataError(f"{path}: {exc}") from None


@functools.lru_cache(maxsize=256)
def _parquet_decoded_bytes(path: str, size: int, modified_ns: int, max_decoded_bytes: int) -> int:
    """`check_parquet_decoded_size`, cached by the file's path, size and modification time (a refusal
    raises, so it is never cached)."""
    return check_parquet_decoded_size(path, max_decoded_bytes, WORKER_BATCH_BYTES)


def _check_json_nesting(path: Path, suffix: str) -> None:
    """A JSON (Lines) file whose rows nest deeper than MAX_JSON_ROW_DEPTH is a DataError naming the line."""
    import gzip

    with gzip.open(path, "rb") if suffix.endswith(".gz") else path.open("rb") as stream:
        if suffix.startswith(".jsonl"):
            for number, line in enumerate(stream, start=1):
                if too_deep_line(line, MAX_JSON_ROW_DEPTH) is not None:
                    raise DataError(
                        f"{path}: line {number} is JSON nested more than {MAX_JSON_ROW_DEPTH} levels deep"
                    )
        elif json_depth(stream.read(), stop_above=MAX_JSON_ROW_DEPTH) > MAX_JSON_ROW_DEPTH:
            raise DataError(f"{path}: JSON nested more than {MAX_JSON_ROW_DEPTH} levels deep")


def load_split(spec: str | Path, *, max_decoded_bytes: int = MAX_DATASET_BYTES):
    """`path` or `path:split` (for a DatasetDict folder), read as `load_table` reads it."""
    text = str(spec)
    if ":" in text and not Path(text).exists():
        path, split = text.rsplit(":", 1)
        return load_table(path, split, max_decoded_bytes=max_decoded_bytes)
    return load_table(text, max_decoded_bytes=max_decoded_bytes)


@dataclass
class TaskFields:
    """Which columns hold the text and the label, and what the label means."""

    text_fields: tuple[str, ...]
    label_field: str
    problem_type: str = "single_label_classification"
    label_names: list[str] = field(default_factory=list)
    label_positions: bool = (
        True  # a whole number naming no class is a position (declared names, not inferred)
    )

    @property
    def num_labels(self) -> int:
        return 1 if self.problem_type == "regression" else len(self.label_names)


def detect_fields(
    columns: list[str], text_fields: tuple[str, ...] | list[str] | None = None, label_field: str | None = None
) -> tuple[tuple[str, ...], str]:
    """Pick text and label columns from GLUE-style names unless given; errors name the missing field."""
    if text_fields:
        for name in text_fields:
            if name not in columns:
                raise DataError(f"text field {name!r} is not in the data (columns: {', '.join(columns)})")
        texts = tuple(text_fields)
    else:
        found = find_text_fields(columns)
        if found is None:
            raise DataError(
                f"cannot tell which column holds the text (columns: {', '.join(columns)}); "
                "name it with --text-field"
            )
        texts = found
    if len(texts) not in (1, 2):
        raise DataError(f"one or two text fields are supported, got {len(texts)}")
    if label_field:
        if label_field not in columns:
            raise DataError(f"label field {label_field!r} is not in the data (columns: {', '.join(columns)})")
        label = label_field
    else:
        label = next((c for c in LABEL_FIELD_CANDIDATES if c in columns), None)
        if label is None:
            raise DataError(
                f"cannot tell which column holds the label (columns: {', '.join(columns)}); "
                "name it with --label-field"
            )
    return texts, label


def infer_task_fields(
    dataset,
    text_fields=None,
    label_field=None,
    problem_type: str | None = None,
    label_names: list[str] | None = None,
) -> TaskFields:
    """Detect fields and the label space from the training data; with no `problem_type`, the one rule of
    `pelt_core.labels.infer_problem_type` over every label (declared `label_names` mean classification)."""
    texts, label = detect_fields(list(dataset.column_names), text_fields, label_field)
    values = list(dataset[label])
    if problem_type is None:
        try:
            problem_type = infer_problem_type(values, label)
        except ProblemTypeError as exc:
            raise DataError(str(exc)) from None
        if label_names and problem_type == "regression":
            problem_type = "single_label_classification"
    if problem_type == "regression":
        return TaskFields(texts, label, problem_type, [])
    if label_names:
        names = [str(n) for n in label_names]
    else:  # the distinct values, as the registry infers them (pelt_core.labels)
        flat = [x for v in values for x in (v if isinstance(v, list) else [v]) if x is not None]
        try:
            names = class_names({_hashable(x) for x in flat})
        except ValueError as exc:
            raise DataError(f"label field {label!r}: {exc}") from None
    return TaskFields(texts, label, problem_type, names, label_positions=bool(label_names))


def _hashable(value: Any) -> Any:
    return value if isinstance(value, str | int | float | bool | np.generic) else repr(value)


def hold_out_dev_split(dataset, seed: int):
    """(train, dev) for a task without a validation split: `dev_split_rows(len(dataset))` rows (10%
    capped at 1,000, at least 1) drawn by seed, the rest for training; K-shot samples are then drawn
    from the rest only, so they never overlap the dev split."""
    if len(dataset) < 2:
        raise DataError(
            f"the training data has {len(dataset)} row(s); holding out a dev split needs at least 2"
        )
    held_out = set(
        random.Random(f"dev-split-{seed}").sample(range(len(dataset)), dev_split_rows(len(dataset)))
    )
    rest = [i for i in range(len(dataset)) if i not in held_out]
    return dataset.select(rest), dataset.select(sorted(held_out))


def sample_k_shot(dataset, k: int | None, seed: int):
    """UniPELT's low-resource setting: K training examples drawn at random by seed (all when k is None)."""
    if k is None:
        return dataset
    if k > len(dataset):
        raise DataError(f"k_shot: K={k} is larger than the training set ({len(dataset)} examples)")
    indices = random.Random(seed).sample(range(len(dataset)), k)
    return dataset.select(sorted(indices))


def sample_study_split(dataset, k: int | None, dev_rows: int, seed: int):
    """(train, dev) as UniPELT's low-resource protocol draws them: the training rows shuffled by seed,
    the first K for training (all but the dev rows when K is None) and the next `dev_rows` as the dev
    split for model selection; the two never overlap."""
    train_rows = len(dataset) - dev_rows if k is None else k
    if train_rows < 1 or train_rows + dev_rows > len(dataset):
        wanted = f"K={k}" if k is not None else "at least 1"
        raise DataError(
            f"dev_rows: {wanted} training row(s) and a dev split of {dev_rows} need more rows than the "
            f"training set's {len(dataset)}"
        )
    order = list(range(len(dataset)))
    random.Random(f"study-split-{seed}").shuffle(order)
    train = dataset.select(sorted(order[:train_rows]))
    return train, dataset.select(sorted(order[train_rows : train_rows + dev_rows]))


@dataclass
class Encoded:
    """A tokenised split: variable-length token ids and labels, padded only when batched."""

    input_ids: list[list[int]]
    token_type_ids: list[list[int]] | None
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids in self.input_ids]


def encode_labels(values: list[Any], task: TaskFields, where: str) -> np.ndarray:
    if task.problem_type == "regression":
        try:
            return np.asarray(values, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise DataError(
                f"{where}: label field {task.label_field!r} must hold numbers for regression"
            ) from exc
    index = {name: i for i, name in enumerate(task.label_names)}

    def one(
        value: Any,
    ) -> int:  # by name, else (declared names) a whole number as a position (pelt_core.labels)
        position = label_index(value, task.label_names, index, positions=task.label_positions)
        if position is None:
            positions = f" (nor a position 0..{len(task.label_names) - 1})" if task.label_positions else ""
            raise DataError(
                f"{where}: label {value!r} in field {task.label_field!r} is not one of "
                f"{', '.join(task.label_names)}{positions}"
            )
        return position

    if task.problem_type == "multi_label_classification":
        hot = np.zeros((len(values), len(task.label_names)), dtype=np.float32)
        for row, value in enumerate(values):
            for item in value or []:
                hot[row, one(item)] = 1.0
        return hot
    return np.asarray([one(v) for v in values], dtype=np.int64)


def encode(dataset, tokenizer, task: TaskFields, max_length: int, where: str = "data") -> Encoded:
    """Tokenise once (truncated to max_length, no padding) and map labels to indices."""
    for name in (*task.text_fields, task.label_field):
        if name not in dataset.column_names:
            raise DataError(
                f"{where}: field {name!r} is missing (columns: {', '.join(dataset.column_names)})"
            )
    columns = [["" if t is None else str(t) for t in dataset[name]] for name in task.text_fields]
    tokens = tokenizer(*columns, truncation=True, max_length=max_length)
    token_types = tokens.get("token_type_ids")
    return Encoded(tokens["input_ids"], token_types, encode_labels(dataset[task.label_field], task, where))


def length_grouped_batches(
    lengths: list[int], batch_size: int, seed: int, shuffle: bool = True
) -> list[list[int]]:
    """Batches of similar lengths (little padding) in random order.

    Indices are shuffled, cut into mega-batches of 50 batches, sorted by length inside each, then cut into
    batches whose order is shuffled again. Without shuffle: sorted by length (for evaluation).
    """
    if not shuffle:
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    mega = batch_size * 50
    batches = []
    for start in range(0, len(order), mega):
        chunk = sorted(order[start : start + mega], key=lambda i: lengths[i], reverse=True)
        batches.extend(chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size))
    rng.shuffle(batches)
    return batches


def collate(data: Encoded, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad the selected examples to the longest of them."""
    width = max(len(data.input_ids[i]) for i in indices)
    ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(indices), width), dtype=torch.long)
    types = torch.zeros((len(indices), width), dtype=torch.long) if data.token_type_ids is not None else None
    for row, i in enumerate(indices):
        n = len(data.input_ids[i])
        ids[row, :n] = torch.tensor(data.input_ids[i])
        mask[row, :n] = 1
        if types is not None:
            types[row, :n] = torch.tensor(data.token_type_ids[i])
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.from_numpy(data.labels[indices])}
    if types is not None:
        batch["token_type_ids"] = types
    return batch
