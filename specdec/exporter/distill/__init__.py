"""`specdec distill`: train an EAGLE-style draft head on the target's own features (export extra only)."""
