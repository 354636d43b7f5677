"""Cheap looks at a task's dataset: its columns, split sizes and every split's label column.

Kept apart so that it can be swapped for `pelt_core.data` (which reads the same sources for training):
the registry only calls `resolve_source(...)` and `probe_dataset(...)` (or `probe_dataset_in_child`).

A source is a JSON Lines (.jsonl/.ndjson), CSV (.csv/.tsv) or Parquet file, a mapping of split name
to such files (a "train" split is required), or a folder written by `datasets`' `save_to_disk`
(a DatasetDict with a "train" split, or a single Dataset, taken as the training split).

Data come from users, so the probe streams and bounds what it reads (`DatasetLimits`): JSON Lines in
chunks of whole lines, CSV block by block, Parquet batch by batch after its footer (rows, declared
sizes, values times their width) passed, its texts read dictionary-encoded; rows of one split and decoded
bytes of all splits are counted as they are read, a value repeated on many rows once per row
(`pelt_core.parquet_size`), and refused beyond PELT_MAX_DATASET_ROWS / PELT_MAX_DATASET_BYTES (413). Text files must be UTF-8 (the
trainer reads them so); a JSON Lines row may nest at most `limits.MAX_JSON_ROW_DEPTH` deep (checked on
its bytes: pyarrow's reader crashes on deep ones). A `datasets` folder is checked by
`pelt_core.saved_dataset` first (its own Arrow files only, rows counted from metadata), its tables built
from those files as the trainer builds them (`read_saved_split`) and fully validated. Label columns
are summarized without decoding a dictionary-encoded one; a class label is at most
`limits.MAX_LABEL_CHARS` characters. Errors name the split (`source.<split>`), never a path of this
machine.

Decoding is the part a crafted file can turn against the process (memory, a native reader's crash):
the service runs it in a child process (`probe_dataset_in_child`, `services.sandbox`) under
PELT_DATASET_PROBE_MEMORY_BYTES and PELT_DATASET_PROBE_TIMEOUT_SECONDS; a child that dies is a 422
naming the split it was reading.

The modules, one subject each: `source` (where the data live, supported formats), `records` (limits,
the byte budget and what a probe finds), `probe` (the probe in this process), `files` (split files as
streams of record batches), `saved` (`datasets` folders), `labels` (a label column's summary) and
`child` (the probe in a child process).
"""

from services.registry.dataset_probe.child import probe_dataset_in_child
from services.registry.dataset_probe.probe import probe_dataset
from services.registry.dataset_probe.records import DatasetLimits, DatasetProbe, LabelSummary
from services.registry.dataset_probe.source import FILE_FORMATS, DatasetSource, resolve_source

__all__ = [
    "FILE_FORMATS",
    "DatasetLimits",
    "DatasetProbe",
    "DatasetSource",
    "LabelSummary",
    "probe_dataset",
    "probe_dataset_in_child",
    "resolve_source",
]
