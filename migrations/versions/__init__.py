"""Schema revisions, oldest first. Each one is frozen in time: never edit one that has shipped."""
