"""Build specdec artifacts: draft + target ONNX graphs, tokenizer and manifest.

Needs the `export` extra (torch, transformers, optimum-onnx). Import `run_export` from
`specdec.exporter.pipeline`.
"""
