"""The bodies of the three generation routes, declared once as pydantic models: SGLang's
`/generate` (`GenerateRequest`, its `sampling_params` `SGLangSampling` and its
`session_params` `SessionParams`), OpenAI's `/v1/completions` (`CompletionRequest`) and
`/v1/chat/completions` (`ChatRequest`). Each field's type, default and range is declared
here, and a rule across fields is a model validator. protocol.py validates a body with
its model and builds the engine's requests from it; a body the model refuses is a 400
whose message names the field (`describe`). The app serves the models as its OpenAPI
schema (`openapi_schemas`: /openapi.json, /docs).

Validation is strict, as JSON's types are: a bool is not an int, a float is not an int,
a string is not a number (an int is a number). SGLang's fields are sorted by compat.py:
the used ones are declared here, the ignored ones change nothing, the neutral-only ones
are refused at any other value, and names SGLang does not know either are ignored with
one warning a name. The OpenAI routes ignore the optional fields they do not use and
take the ones they cannot honour at the only values they can (`OPENAI_ONLY`,
`CHAT_ONLY`)."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Tag, ValidationError,
                      WithJsonSchema, model_validator, with_config)
from pydantic.json_schema import models_json_schema
from pydantic_core import PydanticCustomError
from typing_extensions import NotRequired, TypedDict  # pydantic's TypedDict before Python 3.12

from ..engine.request import MAX_TOP_LOGPROBS
from .compat import (GENERATE_IGNORED, GENERATE_NEUTRAL, GENERATE_USED, SAMPLING_IGNORED, SAMPLING_NEUTRAL,
                     SAMPLING_USED, UNKNOWN, neutral)

#: stop strings a request may give: each is looked for after every token, so a request
#: with thousands of them would slow every other request in its batch (OpenAI's limit: 4)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
OPENAI_STOP_STRINGS = 4
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class Body(BaseModel):
    """Strict types, no NaN or infinity, and fields no model declares are ignored (or
    sorted by compat.py, SGLang's)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


# ---------------------------------------------------------------------------- errors
def refused(text: str, field: str = "") -> PydanticCustomError:
    """A rule the body breaks: `text` about `field` (under the error's place), or a
    sentence of its own about the body."""
    return PydanticCustomError("refused", "{text}", {"text": text, "field": field})


def expected(what: str, field: str = "", *value) -> PydanticCustomError:
    """A value that is not `what`: the input's own, or `field`'s `value` under it."""
    ctx = {"what": what, "field": field}
    if value:
        ctx["value"] = f"{value[0]!r:.60}"
    return PydanticCustomError("expected", "must be {what}", ctx)


def unsupported(field: str, value, allowed: str) -> PydanticCustomError:
    """A value asking for what is not implemented."""
    return PydanticCustomError("unsupported", "{value} is not supported (only {allowed})",
                               {"field": field, "value": f"{value!r:.40}", "allowed": allowed})


#: pydantic's error types, as what the value must be
_MUST = {"string_type": "be a string", "int_type": "be an int", "bool_type": "be true or false",
         "float_type": "be a number", "finite_number": "be a finite number", "list_type": "be a list",
         "dict_type": "be an object", "model_type": "be an object", "model_attributes_type": "be an object",
         "none_required": "be null", "literal_error": "be {expected}", "greater_than_equal": "be >= {ge}",
         "greater_than": "be > {gt}", "less_than_equal": "be <= {le}", "less_than": "be < {lt}",
         "string_too_short": "be a non-empty string", "string_too_long": "hold at most {max_length} characters",
         "too_short": "hold at least {min_length} item(s)", "too_long": "hold at most {max_length} items",
         "expected": "be {what}"}


def _place(loc, field: str = "") -> str:
    """`sampling_params[1].top_p` from pydantic's location (a union's tags, `<...>`, left out)."""
    out = ""
    for part in (*loc, field) if field else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith("<"):
            out += f".{part}" if out else part
    return out


def describe(e: ValidationError) -> str:
    """The message of a refused body: its first error, naming the field."""
    err = e.errors(include_url=False)[0]
    kind, ctx = err["type"], err.get("ctx") or {}
    name = _place(err["loc"], ctx.get("field", ""))
    if kind == "refused":
        return f"{name}: {ctx['text']}" if name else ctx["text"]
    if kind == "unsupported":
        return f"{name}={ctx['value']} is not supported (only {ctx['allowed']})"
    if kind == "missing":
        return f"{name} is required"
    value = err.get("input")
    if not name:  # the body itself
        return f"the request body must be a JSON object, got {type(value).__name__}"
    must = _MUST.get(kind)
    must = must.format(**ctx) if must else f"be valid ({err['msg']})"
    return f"{name} must {must}, got {ctx['value'] if 'value' in ctx else f'{value!r:.60}'}"


# ---------------------------------------------------------------------------- types
_KINDS = {str: "<str>", int: "<int>", float: "<float>", bool: "<bool>", list: "<list>", dict: "<dict>",
          type(None): "<null>"}


def _kind(v) -> str | None:
    return _KINDS.get(type(v))


def one_of(what: str, kind=_kind, **forms) -> Any:
    """A value of one of `forms`, picked by its JSON kind (`str=`, `int=`, `list=`,
    `null=` ...; or by `kind`), so that an error is the chosen form's; any other kind
    is `{name} must be {what}`."""
    return Annotated[Union[tuple(Annotated[t, Tag(f"<{k}>")] for k, t in forms.items())],
                     Discriminator(kind, custom_error_type="expected", custom_error_message="must be {what}",
                                   custom_error_context={"what": what})]


def _enum(allowed) -> list:
    """A schema's `enum` of the allowed values (0 and 0.0 are one value in JSON; false and 0 are not)."""
    out = []
    for a in allowed:
        if not neutral(a, out):  # compat's equality: 0 == 0.0, false is not 0
            out.append(a)
    return out


def _top_k(v: int) -> int:
    if v == 0:
        raise expected("-1 (all tokens) or an int >= 1")
    return v


def _false_is_none(v):
    return None if v is False else v


def _falsy_is_none(v):
    return v or None


TokenIds = list[Annotated[int, Ge(0)]]
NonEmpty = Annotated[str, MinLen(1)]
Count = Annotated[int, Ge(1)]                       # new tokens
Temperature = Annotated[float, Ge(0)]
TopP = Annotated[float, Gt(0), Le(1)]
TopK = Annotated[int, Ge(-1), AfterValidator(_top_k), WithJsonSchema(
    {"type": "integer", "minimum": -1, "description": "-1 (all tokens) or an int >= 1"})]
Seed = Annotated[int, Ge(0), Lt(2 ** 63)]
TopLogprobs = Annotated[int, Ge(0), Le(MAX_TOP_LOGPROBS)]
SessionId = one_of("a non-empty string or an int", str=NonEmpty, int=int, null=None)


def stops(most: int) -> Any:
    stop = Annotated[str, MinLen(1), MaxLen(MAX_STOP_CHARS)]
    return one_of(f"a non-empty string or a list of at most {most} of them", str=stop,
                  list=Annotated[list[stop], MaxLen(most)], null=None)


Stops = stops(MAX_STOP_STRINGS)
OpenAIStops = stops(OPENAI_STOP_STRINGS)


def per_prompt(t, kind: str, what: str) -> Any:
    """One value, or in a batch a list of one a prompt."""
    return one_of(f"{what} or (a batch) a list of one a prompt", **{kind: t, "list": list[t], "null": None})


def _sglang_sorting(where: str, used, ignored, neutral_only: dict):
    """compat.py's sorting of SGLang's fields, as a model validator before the fields':
    a neutral-only field at another value is refused (naming it); a name in no table
    is ignored with one warning."""
    known = frozenset(used) | frozenset(ignored) | neutral_only.keys()

    def sort(cls, d):
        if isinstance(d, dict):
            for k in sorted(d.keys() & neutral_only.keys()):
                if not neutral(d[k], neutral_only[k]):
                    raise unsupported(k, d[k], " or ".join("null" if a is None else repr(a) for a in neutral_only[k]))
            unknown = d.keys() - known
            if unknown:
                UNKNOWN.note(where, {k for k in unknown if isinstance(k, str)})
        return d
    return model_validator(mode="before")(classmethod(sort))


def _sglang_schema(ignored, neutral_only: dict):
    """The schema of SGLang's other fields: the neutral-only ones with their values, the
    ignored ones as such."""
    def extra(schema: dict) -> None:
        props = schema.setdefault("properties", {})
        for k in sorted(neutral_only):
            props[k] = {"enum": _enum(neutral_only[k]), "description": "SGLang's; accepted at this value only (or a "
                        "list of them, one a prompt): what any other asks for is not implemented"}
        for k in sorted(ignored):
            props[k] = {"description": "SGLang's; accepted and ignored (it changes nothing here)"}
    return extra


# ---------------------------------------------------------------------------- SGLang's /generate
class SGLangSampling(Body):
    """SGLang's sampling_params (its defaults: 128 new tokens, shortened to the room the
    context leaves when not given; temperature 1)."""

    model_config = ConfigDict(json_schema_extra=_sglang_schema(SAMPLING_IGNORED, SAMPLING_NEUTRAL))
    _sorting = _sglang_sorting("/generate sampling_params", SAMPLING_USED, SAMPLING_IGNORED, SAMPLING_NEUTRAL)

    max_new_tokens: Count | None = None
    temperature: Temperature | None = 1.0
    top_p: TopP | None = 1.0
    top_k: TopK | None = -1
    stop: Stops = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True
    seed: Seed | None = None                 # this server's alias of sampling_seed (the one read when both come)
    sampling_seed: Seed | None = None

    @property
    def the_seed(self) -> int | None:
        return self.seed if "seed" in self.model_fields_set else self.sampling_seed


SESSION_FIELDS = ("id", "rid", "offset", "replace", "drop_previous_output")


class SessionParams(Body):
    """SGLang's session_params: continue turn `rid` (default: the latest) of session `id`
    with only the new tokens, after that turn's prompt and output (its prompt alone with
    drop_previous_output), cut at `offset`. `replace` is refused."""

    id: NonEmpty
    rid: NonEmpty | None = None
    offset: Annotated[int, Ge(0)] | None = None
    replace: bool | None = None
    drop_previous_output: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, d):
        if isinstance(d, dict):
            unknown = d.keys() - cls.model_fields.keys()
            if unknown:
                raise refused(f"unknown field(s) {sorted(unknown)}; it takes {', '.join(SESSION_FIELDS)}")
        return d

    @model_validator(mode="after")
    def _no_replace(self):
        if self.replace:
            raise refused("abort a turn and its branches, then insert this one: not supported; continue from "
                          "the turn before it with session_params.rid", "replace")
        return self


def _no_modalities(v):
    if v and any(m is not None for m in v):
        raise expected("null or empty (no image, video or audio input is supported)")
    return v


def _ids_form(v) -> str | None:
    """input_ids: a list of token ids, or (a batch) a list of such lists."""
    if type(v) is list:
        return "<batch>" if v and type(v[0]) is list else "<one>"
    return None


Strings = per_prompt(str, "str", "a string")
InputIds = one_of("a list of token ids or a list of such lists", _ids_form, one=TokenIds, batch=list[TokenIds],
                  null=None)
Samplings = per_prompt(SGLangSampling, "dict", "an object")
Flags = per_prompt(bool, "bool", "true or false")
TopCounts = per_prompt(int, "int", f"an int in [0, {MAX_TOP_LOGPROBS}]")
Ints = per_prompt(int, "int", "an int")


class GenerateRequest(Body):
    """SGLang's `/generate`: one prompt (`text` or `input_ids`), or a batch (a list of
    them), each field a prompt's own may be one value or a list of one a prompt."""

    model_config = ConfigDict(json_schema_extra=_sglang_schema(GENERATE_IGNORED, GENERATE_NEUTRAL))
    _sorting = _sglang_sorting("/generate", GENERATE_USED, GENERATE_IGNORED, GENERATE_NEUTRAL)

    text: Strings = None
    input_ids: InputIds = None
    sampling_params: Samplings = None
    rid: Strings = None
    stream: bool = False
    session_id: SessionId = None
    session_params: SessionParams | None = None
    priority: int | None = None
    extra_key: Strings = None
    cache_salt: Strings = None
    return_logprob: Flags = None
    top_logprobs_num: TopCounts = None                  # read with return_logprob
    logprob_start_len: Ints = None
    return_text_in_logprobs: bool = False
    modalities: Annotated[list[Any] | None, AfterValidator(_no_modalities)] = None

    @property
    def batched(self) -> bool:
        return isinstance(self.text, list) if self.text is not None else \
            bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def prompts(self) -> list:
        p = self.text if self.text is not None else self.input_ids
        return p if self.batched else [p]

    def each(self, name: str, n: int) -> list:
        """A per-prompt field's value for each of the `n` prompts."""
        v = getattr(self, name)
        return v if isinstance(v, list) else [v] * n

    @model_validator(mode="after")
    def _one_prompt_form(self):
        if (self.text is None) == (self.input_ids is None):
            raise refused("give exactly one of text or input_ids")
        batched, n = self.batched, len(self.prompts)
        for name in ("sampling_params", "rid", "extra_key", "cache_salt", "return_logprob", "top_logprobs_num",
                     "logprob_start_len"):
            v = getattr(self, name)
            if isinstance(v, list):
                if not batched:
                    raise refused("a list is for a batch (one a prompt); this request has one prompt", name)
                if len(v) != n:
                    raise refused(f"{len(v)} given for {n} prompts", name)
        if self.return_logprob and self.top_logprobs_num is not None:
            for i, (asked, top) in enumerate(zip(self.each("return_logprob", n), self.each("top_logprobs_num", n))):
                if asked and top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
                    raise expected(f"an int in [0, {MAX_TOP_LOGPROBS}]", f"top_logprobs_num[{i}]"
                                   if isinstance(self.top_logprobs_num, list) else "top_logprobs_num", top)
        if self.session_params is not None:
            if self.session_id is not None:
                raise refused("give session_id or session_params, not both (as SGLang asks)")
            if batched:
                raise refused("session_params continues one conversation: send one prompt")
        return self


# ---------------------------------------------------------------------------- OpenAI
@with_config(Body.model_config)
class StreamOptions(TypedDict):
    include_usage: NotRequired[bool]                    # default false: no usage chunk at the end


#: OpenAI's fields accepted at these values only (by ==: 1.0 is 1 here), and what any
#: other asks for is not implemented
OPENAI_ONLY = {"n": (1, None), "best_of": (1, None), "logit_bias": (None, {}), "suffix": (None, ""),
               "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None)}
CHAT_ONLY = {**OPENAI_ONLY, "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto")}


def _only_schema(schema: dict, cls) -> None:
    props = schema.setdefault("properties", {})
    for k, allowed in cls.ONLY.items():
        props[k] = {"enum": _enum(allowed), "description": "accepted at this value only: what any other asks for "
                                                           "is not implemented"}


class OpenAIRequest(Body):
    """What OpenAI's completions and chat completions share. `cache_salt` partitions the
    cache as vLLM's does; `session_id` and `top_k` are SGLang's and vLLM's extras. The
    fields in ONLY are taken at their values there only."""

    ONLY: ClassVar[dict] = OPENAI_ONLY
    model_config = ConfigDict(json_schema_extra=_only_schema)

    @model_validator(mode="before")
    @classmethod
    def _only(cls, d):
        """The ONLY fields' values (one validator: one a field would cost every request
        a call each)."""
        if isinstance(d, dict):
            for k, allowed in cls.ONLY.items():
                if k in d and d[k] not in allowed:
                    raise unsupported(k, d[k], " or ".join(map(repr, allowed)))
        return d

    model: str | None = None
    stream: bool = False
    stream_options: Annotated[StreamOptions | None, BeforeValidator(_falsy_is_none)] = None  # false, {}: none
    cache_salt: str | None = None
    session_id: SessionId = None
    max_tokens: Count | None = None
    temperature: Temperature | None = 1.0
    top_p: TopP | None = 1.0
    top_k: TopK | None = -1
    seed: Seed | None = None
    stop: OpenAIStops = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False


def _prompt_form(v) -> str | None:
    if type(v) is str:
        return "<text>"
    if type(v) is list and v:
        return {int: "<ids>", str: "<texts>", list: "<batch>"}.get(type(v[0]))
    return None


Prompt = one_of("a string, a list of strings, a list of token ids or a list of such lists", _prompt_form, text=str,
                ids=TokenIds, texts=list[str], batch=list[TokenIds])


class CompletionRequest(OpenAIRequest):
    """OpenAI's `/v1/completions`: a prompt, or a batch of them. `logprobs`: how many
    alternatives a token (0: the sampled token's alone; false or null: none)."""

    prompt: Prompt
    logprobs: Annotated[TopLogprobs | None, BeforeValidator(_false_is_none)] = None
    echo: bool | None = False

    @model_validator(mode="after")
    def _streamable(self):
        if self.stream and isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int) \
                and len(self.prompt) > 1:
            raise refused("stream with more than one prompt is not supported")
        if self.echo and self.stream:
            raise refused("echo with stream is not supported")
        return self


@with_config(Body.model_config)
class TextPart(TypedDict):
    type: Literal["text"]
    text: str


Content = one_of("a string or a list of text parts", str=str, list=list[TextPart], null=None)


@with_config(Body.model_config)
class Message(TypedDict):
    """A chat message: its role, and its content (text, or text parts). A dict, not a
    model: a long conversation validates its messages several times faster so."""

    role: Literal[CHAT_ROLES]
    content: NotRequired[Content]


class ResponseFormat(Body):
    type: Literal["text"]


class ChatRequest(OpenAIRequest):
    """OpenAI's `/v1/chat/completions`: text messages (content parts of type text only),
    no tools. The count of new tokens: `max_completion_tokens`, else `max_tokens`.
    `logprobs` true gives the output tokens' logprobs, `top_logprobs` alternatives."""

    ONLY: ClassVar[dict] = CHAT_ONLY

    messages: Annotated[list[Message], MinLen(1)]
    max_completion_tokens: Count | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None

    @model_validator(mode="after")
    def _chat_rules(self):
        for i, m in enumerate(self.messages):
            if m.get("content") is None and m["role"] != "assistant":
                raise expected("a string or a list of text parts (null only for the assistant)",
                               f"messages[{i}].content", None)
        if self.top_logprobs and not self.logprobs:
            raise refused("top_logprobs needs logprobs: true")
        return self


# ---------------------------------------------------------------------------- the schema
#: each route's body
ROUTES = {"/generate": GenerateRequest, "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest}
SCHEMAS = "#/components/schemas/{model}"


def request_body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra`: its JSON body is `model` (the route reads and validates it
    itself, so that a bad one is a 400 naming the field)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": SCHEMAS.format(model=model.__name__)}}}}}


def openapi_schemas() -> dict:
    """The request models' JSON schemas (and the models they hold), by name, for the
    OpenAPI document's components."""
    _, top = models_json_schema([(m, "validation") for m in ROUTES.values()], ref_template=SCHEMAS)
    return top.get("$defs", {})
