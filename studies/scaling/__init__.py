"""Scaling studies of the variants, one package: the command line (`cli`, run as `python -m studies.scaling`),
the runs' processes and rows (`runs`), the ladder of stable runs and cooldown branches (`ladder`), learning
rates and µP's transfer check (`lr`), the IsoFLOP grid (`isoflop`), its analysis (`profiles`) and the
fits of the older ladder (`fit`). Kept free of imports, so that reading one module (a results page reads
`profiles`) does not load the trainer."""
