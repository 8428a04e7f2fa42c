from specdec.bench.report import _prompt_set_name, goals_section


def _group(group, config, speedup, share):
    return {"group": group, "config": config, "speedup": speedup, "share_of_theory": share,
            "share_of_theory_verify": share}


def test_a_goal_figure_just_below_its_threshold_never_reads_as_met():
    groups = [_group("grounded", "ngram auto", 1.9999, 0.8499), _group("grounded", "ngram K=4", 2.0, 0.85)]
    rows = [{"config": "ngram auto", "group": "open", "speedup": 0.94999, "prompt": "ideas"}]
    anchors = [{"system": "onnxruntime-genai greedy", "group": "open", "ratio": 0.8999}]
    text = "\n".join(goals_section(groups, rows, anchors))
    assert "| grounded | 84.9% / 84.9% | no / no |" in text
    assert "| grounded | 85.0% / 85.0% | yes / yes |" in text
    assert "| grounded | 1.99x | no |" in text and "| grounded | 2.00x | yes |" in text
    assert "| open | min 0.94x (ideas) | no |" in text
    assert "| open | 0.89x | no |" in text
    # Float error must not round an exact figure down: 0.29 * 100 is 28.999999999999996.
    exact = goals_section([_group("open", "ngram K=4", 1.0, 0.29)], [], [{"system": "onnxruntime-genai greedy",
                                                                        "group": "open", "ratio": 0.29}])
    assert "| open | 29.0% / 29.0% |" in "\n".join(exact) and "| open | 0.29x | no |" in "\n".join(exact)


def test_prompt_set_name():
    assert _prompt_set_name({"prompt_set_version": 1, "prompt_set_file": "prompts.jsonl"}) == "v1"
    assert _prompt_set_name({"prompt_set_version": None, "prompt_set_file": "mine.jsonl"}) == "mine.jsonl"


def test_the_report_says_where_autos_table_came_from():
    from specdec.bench.report import _auto_table_origin

    assert "timed target calls" in _auto_table_origin({"call_costs_source": "timed", "calibration_seconds": 1.5})
    assert "call-cost cache" in _auto_table_origin({"call_costs_source": "cache", "calibration_seconds": 0.0})
    assert "specdec tune" in _auto_table_origin({"call_costs_source": "tune"})
    assert _auto_table_origin({"call_costs_source": None, "calibration_seconds": 0.0}) == ""
