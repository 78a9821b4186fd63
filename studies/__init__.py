"""Studies that orchestrate training and evaluation runs: the README demo and the paper's
comparison (`demo`), scaling studies and their analysis (the `scaling` package), and memorization
capacity (`capacity`). They sit above `eval/` and `pretrain/` and are the only code that uses both."""
