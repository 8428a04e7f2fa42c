"""vLLM's tokenizer routes, as lm-evaluation-harness's remote tokenizer reads them."""

from __future__ import annotations

import httpx

from tests.serve.conftest import MODEL


def _post(server, path, **body):
    return httpx.post(server.url + path, json=body, timeout=30)


def test_tokenize_and_detokenize_use_the_served_tokenizer(server, serve_engine):
    codec = serve_engine.codec
    text = "The quick brown fox, and 東京."
    reply = _post(server, "/tokenize", model=MODEL, prompt=text).json()
    assert reply["tokens"] == codec.encode(text) and reply["count"] == len(reply["tokens"])
    assert reply["max_model_len"] == serve_engine.max_positions
    bare = _post(server, "/tokenize", prompt=text, add_special_tokens=False, return_token_strs=True).json()
    assert bare["tokens"] == codec.encode(text, add_special_tokens=False)
    assert bare["token_strs"] == [codec.tokenizer.id_to_token(t) for t in bare["tokens"]]
    messages = [{"role": "user", "content": "Hello"}]
    chat = _post(server, "/tokenize", messages=messages).json()
    assert chat["tokens"] == codec.encode(codec.chat_prompt(messages), add_special_tokens=False)
    assert _post(server, "/detokenize", tokens=bare["tokens"]).json() == {"prompt": codec.decode(bare["tokens"])}


def test_tokenizer_info_names_an_eos_token_that_tokenizes_to_its_id(server, serve_engine):
    """lm-evaluation-harness's check: /tokenizer_info has eos_token, /tokenize answers with tokens; it then takes
    the EOS id as the first token of the EOS text."""
    info = httpx.get(server.url + "/tokenizer_info", timeout=30).json()
    assert info["chat_template"] == serve_engine.manifest.tokenizer.chat_template
    eos = _post(server, "/tokenize", prompt=info["eos_token"], add_special_tokens=False).json()["tokens"]
    assert eos[0] in serve_engine.manifest.tokenizer.eos_token_ids


def test_bad_tokenizer_requests_get_a_4xx_naming_the_field(server):
    cases = [("/tokenize", {}, 400, "prompt"), ("/tokenize", {"prompt": "a", "messages": []}, 400, "prompt"),
             ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": False}, 400,
              "add_generation_prompt"),
             ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens"), ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
             ("/tokenize", {"model": "gpt-4o", "prompt": "a"}, 404, "model")]
    for path, body, status, param in cases:
        reply = _post(server, path, **body)
        assert reply.status_code == status, (path, body, reply.text)
        assert reply.json()["error"]["param"] == param
