"""`python -m raytrain_lm.cli`, as Ray jobs run it: the `raytrain-lm` program."""

from raytrain_lm.cli.entry import main

main()
