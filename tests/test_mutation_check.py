"""The mutation check (tools/mutation_check.py) stays able to bite: cheap checks, run with the suite.

The check itself (`make mutants`) is slow; these make sure a refactor cannot silently disable a
mutant (its patch no longer applies) or point it at the installed code instead of the scratch copy.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from tools import mutation_check as mc

ROOT = Path(__file__).resolve().parent.parent


def test_every_mutant_still_applies_to_the_current_source_and_compiles():
    assert mc.check_patches(ROOT) == []
    for mutant in mc.MUTANTS:
        source = (ROOT / mutant.path).read_text()
        assert mc.apply(source, mutant) != source, mutant.name


def test_the_issues_bugs_each_have_a_mutant():
    names = " | ".join(m.name for m in mc.MUTANTS)
    for bug in ("residual p - p", "unprocessed q", "only q(x)", "on p but not on q", "bonus token from the residual",
                "one-hot draft accepted with probability", "target KV rollback keeps", "target KV rollback drops",
                "draft KV rollback keeps", "draft KV rollback drops", "overshooting max_new_tokens",
                "acceptance rate counting bonus", "accepted count past EOS"):
        assert bug in names, bug
    assert len({m.name for m in mc.MUTANTS}) == len(mc.MUTANTS)


def test_a_patch_that_no_longer_applies_is_an_error():
    mutant = mc.MUTANTS[0]
    with pytest.raises(mc.MutationError, match="0 times"):
        mc.apply("nothing to patch here", mutant)
    with pytest.raises(mc.MutationError, match="2 times"):
        mc.apply(mutant.old + "\n" + mutant.old, mutant)


def test_the_scratch_copy_is_what_the_tests_import(tmp_path):
    mc.make_scratch(ROOT, tmp_path)
    env = mc.scratch_env(tmp_path, tmp_path / "artifacts")
    seen = mc.imported_from(tmp_path, env, "specdec.runtime.acceptance")
    assert seen == tmp_path / "specdec" / "runtime" / "acceptance.py"
    # a patched scratch file is what runs
    path = tmp_path / "specdec" / "runtime" / "acceptance.py"
    path.write_text(mc.apply(path.read_text(), mc.MUTANTS[0]))
    code = ("import numpy as np; from specdec.runtime.acceptance import residual_distribution as r; "
            "print(r(np.array([0.5, 0.5]), np.array([1.0, 0.0])).tolist())")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[0.5, 0.5]"  # p - p: the residual fell back to p, where the real one is [0, 1]
