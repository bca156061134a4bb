"""`data.curate`: the stages `prepare` applies to each document before tokenizing."""
