"""The exactness certificate for a new machine: `python -m specdec.certify.device_check ART... --provider cuda`.

Not a benchmark: it passes or fails. Runtime only (numpy, onnxruntime, tokenizers), so it runs where the
exporter cannot be installed.
"""
