"""Commits and discovery (above storage/): the group protocol's files (``protocol``), attempt
tokens through torch.distributed's store (``attempts``), the per-rank commit work
(``coordinator``) and the one ``latest`` rule (``discovery``). See docs/groups.md."""
