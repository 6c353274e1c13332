"""The official `ollama`, `openai` and `anthropic` Python clients against `mlx-runner serve`.

Run by tests/clients.rs, which starts `serve` over a store holding the fixture models `gem`
(gemma4), `glm` (GLM4-MoE-Lite), `vis` (gemma4 with a vision tower) and `aud` (gemma4 with audio
and vision towers) and passes its address (MLX_SERVE_URL), its pid (MLX_SERVE_PID), a checkpoint
directory to upload (MLX_FIXTURE_DIR), a directory of images (MLX_IMAGES_DIR) and one of audio
clips (MLX_AUDIO_DIR). Every check prints one line; the first failure raises.
"""

import asyncio
import hashlib
import json
import os
import signal
import time

import anthropic
import ollama
import openai

URL = os.environ["MLX_SERVE_URL"]
SERVE_PID = int(os.environ["MLX_SERVE_PID"])
FIXTURE = os.environ["MLX_FIXTURE_DIR"]
IMAGES = os.environ["MLX_IMAGES_DIR"]
AUDIO = os.environ["MLX_AUDIO_DIR"]

client = ollama.Client(host=URL)
oai = openai.OpenAI(base_url=URL + "/v1", api_key="unused")
ant = anthropic.Anthropic(base_url=URL, api_key="unused", max_retries=0)
GREEDY = {"temperature": 0, "num_predict": 12}


def check(name):
    def wrap(f):
        f()
        print(f"ok   {name}", flush=True)
        return f

    return wrap


def runners():
    """The runner processes serve has spawned."""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            stat = open(f"/proc/{p}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[1]) == SERVE_PID and fields[0] != "Z":
            try:
                args = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            # Not serve's template renderers.
            if len(args) > 1 and args[1] == b"runner":
                out.append(int(p))
    return out


@check("ollama: list and show")
def _():
    names = sorted(m.model for m in client.list().models)
    assert names == ["aud:latest", "gem:latest", "glm:latest", "vis:latest"], names
    info = client.show("gem")
    assert "completion" in info.capabilities, info.capabilities
    assert "<|turn>" in info.template
    assert info.details.format == "safetensors"


@check("ollama: chat and generate, streaming and not")
def _():
    for model in ("gem", "glm"):
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
        whole = client.chat(model=model, messages=msgs, options=GREEDY, think=False)
        # A random model may end early on its EOS: "stop"; otherwise the 12 tokens: "length".
        assert whole.done and whole.done_reason in ("stop", "length"), whole
        assert whole.eval_count == 12 or whole.done_reason == "stop", whole
        assert whole.total_duration > 0 and whole.eval_count > 0
        parts = list(client.chat(model=model, messages=msgs, options=GREEDY, think=False, stream=True))
        assert parts[-1].done
        assert "".join(p.message.content for p in parts) == whole.message.content
        gen = client.generate(model=model, prompt="Once upon", options=GREEDY, think=False)
        streamed = "".join(p.response for p in client.generate(model=model, prompt="Once upon", options=GREEDY, think=False, stream=True))
        assert streamed == gen.response


@check("ollama: thinking is returned apart from the answer")
def _():
    r = client.chat(model="glm", messages=[{"role": "user", "content": "Hi"}], options=GREEDY, think=True)
    # GLM's prompt ends inside a thought: what comes before </think> is thinking.
    assert r.message.thinking or r.message.content is not None


@check("ollama: stop strings and seeded sampling")
def _():
    full = client.generate(model="gem", prompt="Hello there", options=GREEDY, think=False).response
    stop = full[4:6]
    cut = client.generate(model="gem", prompt="Hello there", options={**GREEDY, "stop": [stop]}, think=False)
    assert full.startswith(cut.response) and len(cut.response) <= 4, (full, stop, cut.response)
    assert cut.done_reason == "stop"
    seeded = {"temperature": 0.9, "seed": 11, "num_predict": 10}
    a = client.generate(model="glm", prompt="Tell me", options=seeded, think=False).response
    b = client.generate(model="glm", prompt="Tell me", options=seeded, think=False).response
    assert a == b


def get_weather(city: str) -> str:
    """Get the weather in a city.

    Args:
      city: The city's name
    """
    return "sunny"


@check("ollama: tools in, tool calls and results back in the history")
def _():
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat(model="gem", messages=msgs, tools=[get_weather], options=GREEDY, think=False)
    assert r.done
    msgs.append(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        }
    )
    msgs.append({"role": "tool", "tool_name": "get_weather", "content": "sunny"})
    r = client.chat(model="gem", messages=msgs, tools=[get_weather], options=GREEDY, think=False)
    assert r.done and isinstance(r.message.content, str)


@check("ollama: ps, copy, delete")
def _():
    client.generate(model="gem", prompt="x", options={"num_predict": 1})
    loaded = [m.model for m in client.ps().models]
    assert "gem:latest" in loaded, loaded
    client.copy("gem", "gem-copy:v1")
    assert "gem-copy:v1" in [m.model for m in client.list().models]
    client.delete("gem-copy:v1")
    assert "gem-copy:v1" not in [m.model for m in client.list().models]
    try:
        client.delete("gem-copy:v1")
        raise AssertionError("deleting a missing model succeeded")
    except ollama.ResponseError as e:
        assert e.status_code == 404


@check("ollama: create from a model, and from uploaded checkpoint files")
def _():
    progress = list(client.create(model="terse", from_="gem", system="You are terse.", parameters={"temperature": 0, "num_predict": 3}, stream=True))
    assert progress[-1].status == "success", progress
    info = client.show("terse")
    assert "You are terse." in info.modelfile, info.modelfile
    assert "temperature" in info.parameters, info.parameters
    r = client.generate(model="terse", prompt="Hi", think=False)
    # The stored num_predict applies (a random model may also end early on its EOS).
    assert r.eval_count == 3 or (r.done_reason == "stop" and r.eval_count < 3), r
    files = {}
    for name in sorted(os.listdir(FIXTURE)):
        if name == "golden.safetensors":
            continue
        path = os.path.join(FIXTURE, name)
        files[name] = client.create_blob(path)
        with open(path, "rb") as f:
            assert files[name] == "sha256:" + hashlib.sha256(f.read()).hexdigest()
    done = client.create(model="uploaded", files=files, quantize="q8")
    assert done.status == "success", done
    details = client.show("uploaded").details
    assert details.quantization_level.upper() in ("Q8", "INT8", "Q8_0"), details
    r = client.generate(model="uploaded", prompt="Hi", options={"num_predict": 4})
    assert r.eval_count == 4 or (r.done_reason == "stop" and r.eval_count < 4), r
    client.delete("uploaded")
    client.delete("terse")


@check("ollama: four concurrent clients get what they get alone")
def _():
    prompts = ["One", "Two words", "Three more words", "Four words here now"]
    alone = [client.generate(model="gem", prompt=p, options=GREEDY, think=False).response for p in prompts]

    async def together():
        c = ollama.AsyncClient(host=URL)
        rs = await asyncio.gather(*(c.generate(model="gem", prompt=p, options=GREEDY, think=False) for p in prompts))
        return [r.response for r in rs]

    assert asyncio.run(together()) == alone


@check("ollama: a client that leaves mid-stream changes nothing for the next")
def _():
    stream = client.generate(model="gem", prompt="Hello", options={"temperature": 0, "num_predict": 2000}, stream=True)
    next(iter(stream))
    stream.close()
    r = client.generate(model="gem", prompt="Hello there", options=GREEDY, think=False)
    assert r.eval_count == 12


@check("ollama: a runner killed mid-request gives an error; the next request gets a new one")
def _():
    client.generate(model="gem", prompt="x", options={"num_predict": 1})
    before = runners()
    assert before
    stream = client.generate(model="gem", prompt="Hello", options={"temperature": 0, "num_predict": 4000}, stream=True)
    it = iter(stream)
    next(it)
    for p in before:
        os.kill(p, signal.SIGKILL)
    try:
        for _ in it:
            pass
        raise AssertionError("the stream ended without an error")
    except ollama.ResponseError as e:
        assert "runner" in str(e), e
    r = client.generate(model="gem", prompt="Hello there", options=GREEDY, think=False)
    assert r.eval_count == 12
    assert set(runners()).isdisjoint(before)


@check("ollama: keep_alive unloads an idle model")
def _():
    client.generate(model="glm", prompt="x", options={"num_predict": 1}, keep_alive="1s")
    start = time.time()
    while "glm:latest" in [m.model for m in client.ps().models]:
        assert time.time() - start < 15, "glm stayed loaded"
        time.sleep(0.1)
    client.generate(model="gem", keep_alive=0)
    assert "gem:latest" not in [m.model for m in client.ps().models]


@check("openai: models, chat (streaming with usage), completions")
def _():
    ids = sorted(m.id for m in oai.models.list().data)
    assert ids == ["aud:latest", "gem:latest", "glm:latest", "vis:latest"], ids
    assert oai.models.retrieve("glm:latest").id == "glm:latest"
    kw = dict(model="gem", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0, reasoning_effort="none")
    whole = oai.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8
    c = oai.completions.create(model="glm", prompt="Once", max_tokens=5, temperature=0, seed=1)
    assert c.usage.completion_tokens == 5 and isinstance(c.choices[0].text, str)


@check("openai: response_format json_schema")
def _():
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    for seed in range(3):
        r = oai.chat.completions.create(
            model="glm",
            messages=[{"role": "user", "content": "A person"}],
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
        )
        v = json.loads(r.choices[0].message.content)
        assert set(v) == {"name", "age"} and 0 <= v["age"] <= 99, v


@check("openai: a required tool call, its result, the answer")
def _():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
                    "required": ["city"],
                },
            },
        }
    ]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = oai.chat.completions.create(model="gem", messages=msgs, tools=tools, tool_choice="required", seed=5, max_tokens=100)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(args["city"], str), args
    msgs.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
    msgs.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})
    r = oai.chat.completions.create(model="gem", messages=msgs, tools=tools, max_tokens=5, temperature=0)
    assert isinstance(r.choices[0].message.content, str)
    # Streaming delivers the call in a delta.
    chunks = list(oai.chat.completions.create(model="gem", messages=msgs[:1], tools=tools, tool_choice="required", seed=5, max_tokens=100, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@check("openai: errors are OpenAI errors")
def _():
    try:
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError:
        pass
    try:
        oai.chat.completions.create(model="gem", messages=[{"role": "user", "content": "x"}], temperature="hot")
        raise AssertionError("bad temperature accepted")
    except openai.BadRequestError:
        pass


@check("openai: json_object mode answers an object; n and logit_bias are refused, not ignored")
def _():
    for seed in range(4):
        r = oai.chat.completions.create(
            model="gem", messages=[{"role": "user", "content": "JSON please"}], seed=seed, max_tokens=200,
            response_format={"type": "json_object"},
        )
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content
    for extra in ({"n": 2}, {"logit_bias": {"5": 10}}):
        try:
            oai.chat.completions.create(model="gem", messages=[{"role": "user", "content": "x"}], **extra)
            raise AssertionError(f"{extra} accepted")
        except openai.BadRequestError as e:
            assert str(e), extra


@check("openai: the Responses API, streaming and not, with a function call round trip")
def _():
    r = oai.responses.create(model="gem", input="Hello", instructions="Be brief.", max_output_tokens=8, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
    assert r.usage.output_tokens == 8 and isinstance(r.output_text, str), r
    events = list(oai.responses.create(model="gem", input="Hello", instructions="Be brief.", max_output_tokens=8,
                                       temperature=0, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    # Cut by max_output_tokens: the stream ends incomplete, as OpenAI's does.
    assert events[-1].type == "response.incomplete", events[-1]
    assert streamed == r.output_text == events[-1].response.output_text, (streamed, r.output_text)
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                             "required": ["city"]}}]
    with oai.responses.stream(model="gem", input="Weather in Paris?", tools=tools, tool_choice="required",
                              max_output_tokens=200) as s:
        r = s.get_final_response()
    assert r.status == "completed", r
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather", r.output
    args = json.loads(calls[0].arguments)
    assert isinstance(args["city"], str), args
    history = [{"role": "user", "content": "Weather in Paris?"}, calls[0].model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]
    after = oai.responses.create(model="gem", input=history, tools=tools, max_output_tokens=6)
    assert after.output and after.usage.input_tokens > 0, after
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"]}
    r = oai.responses.create(model="glm", input="A person", max_output_tokens=80, extra_body={"seed": 1},
                             text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    assert set(json.loads(r.output_text)) == {"name", "age"}, r.output_text


@check("ollama and openai: embeddings are refused with a reason")
def _():
    try:
        client.embed(model="gem", input="hello")
        raise AssertionError("embeddings from a text model")
    except ollama.ResponseError as e:
        assert "does not support embeddings" in str(e), e
    try:
        oai.embeddings.create(model="gem", input="hello")
        raise AssertionError("embeddings from a text model")
    except openai.BadRequestError as e:
        assert "does not support embeddings" in str(e), e


@check("anthropic: messages, streaming and not, with a system prompt")
def _():
    msgs = [{"role": "user", "content": "Hello"}]
    # Current SDKs send no sampling parameters; older ones and raw HTTP do, and serve reads them.
    greedy = {"extra_body": {"temperature": 0}}
    m = ant.messages.create(model="gem", max_tokens=8, system="Be brief.", messages=msgs, **greedy)
    assert m.type == "message" and m.role == "assistant", m
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0, m
    text = "".join(b.text for b in m.content if b.type == "text")
    with ant.messages.stream(model="gem", max_tokens=8, system="Be brief.", messages=msgs, **greedy) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text, (streamed, text)
    assert final.usage.output_tokens == m.usage.output_tokens and final.stop_reason == m.stop_reason


@check("anthropic: a forced tool_use, its tool_result, the answer")
def _():
    tools = [{
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                           "days": {"type": "integer"}}, "required": ["city"]},
    }]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    m = ant.messages.create(model="gem", max_tokens=200, tools=tools, tool_choice={"type": "any"}, messages=msgs)
    assert m.stop_reason == "tool_use", m
    use = [b for b in m.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and isinstance(use.input["city"], str), use
    msgs.append({"role": "assistant", "content": [b.model_dump() for b in m.content]})
    msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]})
    answer = ant.messages.create(model="gem", max_tokens=5, tools=tools, messages=msgs)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use"), answer
    with ant.messages.stream(model="gem", max_tokens=200, tools=tools, messages=msgs[:1],
                             tool_choice={"type": "tool", "name": "get_weather"}) as s:
        final = s.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and uses and isinstance(uses[0].input["city"], str), final


@check("anthropic: thinking blocks, token counts, errors in Anthropic's shape")
def _():
    m = ant.messages.create(model="glm", max_tokens=12, messages=[{"role": "user", "content": "Hi"}],
                            thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.content and all(b.type in ("thinking", "text") for b in m.content), m
    # GLM's prompt ends inside a thought: what comes first is thinking.
    assert m.content[0].type == "thinking", m
    n = ant.messages.count_tokens(model="gem", messages=[{"role": "user", "content": "Hello there"}])
    assert n.input_tokens > 2, n
    try:
        ant.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "x"}])
        raise AssertionError("unknown model accepted")
    except anthropic.NotFoundError as e:
        assert e.body["error"]["type"] == "not_found_error", e.body
    try:
        ant.messages.create(model="gem", max_tokens=-1, messages=[{"role": "user", "content": "x"}])
        raise AssertionError("max_tokens -1 accepted")
    except anthropic.BadRequestError as e:
        assert "max_tokens" in e.body["error"]["message"], e.body


@check("anthropic: output_config.format gives exactly the schema's keys")
def _():
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"]}
    done = 0
    for seed in range(4):
        m = ant.messages.create(model="gem", max_tokens=60, messages=[{"role": "user", "content": "A person"}],
                                output_config={"format": {"type": "json_schema", "schema": person}},
                                extra_body={"temperature": 0.9, "seed": seed})
        if m.stop_reason == "end_turn":
            v = json.loads(m.content[0].text)
            assert set(v) == {"name", "age"}, v
            done += 1
    assert done > 0


@check("ollama, openai, anthropic: images in chats and prompts")
def _():
    import base64

    assert "vision" in client.show("vis").capabilities
    wide, small = (os.path.join(IMAGES, f) for f in ("wide.png", "small.png"))
    # ollama: image paths in a chat message (the client sends their bytes), twice the same answer
    # (the second from the runner's prefix cache, images included).
    msgs = [{"role": "user", "content": "What is in this picture?", "images": [wide]}]
    first = client.chat(model="vis", messages=msgs, options=GREEDY)
    again = client.chat(model="vis", messages=msgs, options=GREEDY)
    assert first.message.content == again.message.content
    assert first.prompt_eval_count > 62, first.prompt_eval_count  # 60 soft tokens, boi, eoi
    # A raw prompt naming two images: the runner's expansion of exactly this prompt.
    r = client.generate(model="vis", prompt="Describe [img-0] and [img-1] now.", raw=True,
                        images=[wide, small], options={"temperature": 0, "num_predict": 4})
    assert r.prompt_eval_count == 143, r.prompt_eval_count
    data = base64.b64encode(open(wide, "rb").read()).decode()
    o = oai.chat.completions.create(model="vis", max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                     {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]}])
    assert o.usage.prompt_tokens > 62, o.usage
    a = ant.messages.create(model="vis", max_tokens=4, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                                     {"type": "text", "text": "What is in this picture?"}]}])
    assert a.usage.input_tokens > 62, a.usage
    # A model without vision says so.
    try:
        client.chat(model="gem", messages=msgs)
        raise AssertionError("an image accepted by a model without vision")
    except ollama.ResponseError as e:
        assert "does not support images" in str(e), e


@check("ollama, openai: audio in chats, prompts and transcriptions")
def _():
    import base64

    caps = client.show("aud").capabilities
    assert "audio" in caps and "vision" in caps, caps
    wav = os.path.join(AUDIO, "speechlike.wav")
    # ollama sends clips as images (their bytes); the second time from the prefix cache.
    msgs = [{"role": "user", "content": "What is said?", "images": [wav]}]
    first = client.chat(model="aud", messages=msgs, options=GREEDY)
    again = client.chat(model="aud", messages=msgs, options=GREEDY)
    assert first.message.content == again.message.content
    assert first.prompt_eval_count > 27, first.prompt_eval_count  # 25 soft tokens, boa, eoa
    # A raw prompt with a clip and an image: the runner's expansion of exactly this prompt.
    r = client.generate(model="aud", prompt="Hear [img-0] and see [img-1] now.", raw=True,
                        images=[wav, os.path.join(AUDIO, "wide.png")],
                        options={"temperature": 0, "num_predict": 4})
    assert r.prompt_eval_count == 104, r.prompt_eval_count
    data = base64.b64encode(open(wav, "rb").read()).decode()
    o = oai.chat.completions.create(model="aud", max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is said?"},
                                     {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}]}])
    assert o.usage.prompt_tokens > 27, o.usage
    # OpenAI's transcription endpoint, as the client uploads a file.
    with open(wav, "rb") as f:
        t = oai.audio.transcriptions.create(model="aud", file=f)
    assert isinstance(t.text, str), t
    with open(wav, "rb") as f:
        text = oai.audio.transcriptions.create(model="aud", file=f, response_format="text")
    assert isinstance(text, str) and text == text.strip(), repr(text)
    # A model without audio says so.
    try:
        client.chat(model="vis", messages=msgs)
        raise AssertionError("a clip accepted by a model without audio")
    except ollama.ResponseError as e:
        assert "does not support audio" in str(e), e


print("all client checks passed")
