"""Demo training: the trainers of the shipped demo models, their data, the demo itself and the plots.

Not part of the product: nothing in `models/` (outside this package), `export/`, `plugins/` or `service/`
imports it (tests/project/test_layout.py checks). Needs the `train` extra (scikit-learn, matplotlib).
`python -m models.training` is its command line.
"""
