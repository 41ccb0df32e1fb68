"""Training drafters for a target: `dynaspec train-draft` (EAGLE-3 heads, ``train.eagle3``)."""
