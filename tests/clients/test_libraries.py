"""The libraries people build on the official clients, against `mlx-runner serve`: structured
output and tools, which is what they are mostly used for.

Run by tests/clients.rs over the fixture models `gem` (gemma4) and `glm` (GLM4-MoE-Lite) at
MLX_SERVE_URL. The models are tiny and random: what is checked is what the server guarantees
(JSON mode gives an object, a schema gives exactly its fields and types, a forced call gives a
parsed, typed call), not what a real model would say. Every check prints one line; the first
failure raises.
"""

import json
import os

from pydantic import BaseModel, Field

URL = os.environ["MLX_SERVE_URL"]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


def get_weather(city: str, days: int) -> str:
    """The weather in a city for the next days.

    Args:
        city: The city.
        days: How many days.
    """
    return "sunny"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city for the next days",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}


def check(name):
    def wrap(f):
        f()
        print(f"ok   {name}", flush=True)
        return f

    return wrap


@check("langchain-ollama: chat, JSON mode, structured output")
def _():
    from langchain_ollama import ChatOllama

    for model in ("gem", "glm"):
        llm = ChatOllama(model=model, base_url=URL, temperature=0, num_predict=8, reasoning=False)
        assert isinstance(llm.invoke("Hello").content, str)
        jsonish = ChatOllama(model=model, base_url=URL, format="json", num_predict=150, seed=3, reasoning=False)
        text = jsonish.invoke("A JSON object please").content
        assert text.startswith("{"), text
        structured = ChatOllama(model=model, base_url=URL, num_predict=80, seed=1, reasoning=False)
        p = structured.with_structured_output(Person, method="json_schema").invoke("A person")
        assert isinstance(p, Person), p


@check("langchain-openai: chat, JSON mode, structured output, a required tool call")
def _():
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="gem", base_url=URL + "/v1", api_key="unused", max_tokens=120, seed=2,
                     max_retries=0)
    assert isinstance(llm.invoke("Hello").content, str)
    p = llm.with_structured_output(Person, method="json_schema").invoke("A person")
    assert isinstance(p, Person), p
    # A random model's free-form objects often outrun the fixture's context; this seed's ends.
    raw = llm.bind(response_format={"type": "json_object"}, seed=3).invoke("JSON").content
    assert isinstance(json.loads(raw), dict), raw
    calls = llm.bind_tools([WEATHER], tool_choice="required").invoke("Weather in Paris?").tool_calls
    assert calls and calls[0]["name"] == "get_weather", calls
    args = calls[0]["args"]
    assert isinstance(args["city"], str) and isinstance(args["days"], int), args


@check("instructor: JSON-schema and tools modes give a validated model")
def _():
    import instructor
    import openai

    for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS):
        client = instructor.from_openai(openai.OpenAI(base_url=URL + "/v1", api_key="unused"), mode=mode)
        p = client.chat.completions.create(
            model="gem", response_model=Person, max_retries=0, max_tokens=120, seed=4,
            messages=[{"role": "user", "content": "A person"}],
        )
        assert isinstance(p, Person), (mode, p)


@check("llama-index (ollama): complete, JSON mode, structured prediction")
def _():
    from llama_index.core.prompts import PromptTemplate
    from llama_index.llms.ollama import Ollama

    llm = Ollama(model="gem", base_url=URL, request_timeout=120, temperature=0,
                 additional_kwargs={"num_predict": 8}, thinking=False)
    assert isinstance(llm.complete("Hello").text, str)
    j = Ollama(model="glm", base_url=URL, request_timeout=120, json_mode=True, thinking=False,
               additional_kwargs={"num_predict": 150, "seed": 5})
    text = j.complete("A JSON object").text
    assert text.startswith("{"), text
    s = Ollama(model="gem", base_url=URL, request_timeout=120, thinking=False,
               additional_kwargs={"num_predict": 80, "seed": 6})
    p = s.structured_predict(Person, PromptTemplate("A person named {name}"), name="Ada")
    assert isinstance(p, Person), p


@check("litellm: ollama and openai-compatible routes, JSON mode, a required tool call")
def _():
    import litellm

    r = litellm.completion(model="ollama_chat/gem", api_base=URL, messages=[{"role": "user", "content": "Hi"}],
                           max_tokens=8, temperature=0)
    assert isinstance(r.choices[0].message.content, str), r
    r = litellm.completion(model="openai/gem", api_base=URL + "/v1", api_key="unused", max_tokens=120, seed=3,
                           messages=[{"role": "user", "content": "JSON"}], response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content
    r = litellm.completion(model="openai/gem", api_base=URL + "/v1", api_key="unused", max_tokens=200,
                           messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                           tool_choice="required")
    call = r.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(args["days"], int), args
    try:
        litellm.embedding(model="ollama/gem", api_base=URL, input=["hello"])
        raise AssertionError("embeddings from a text model")
    except Exception as e:
        assert "does not support embeddings" in str(e), e


print("all library checks passed")
