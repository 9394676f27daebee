"""``response_format`` (OpenAI's structured output) as the engine's ``GrammarSpec``, checked here.

``{"type": "text"}`` (or none): free text. ``{"type": "json_object"}``: any JSON object.
``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``: JSON
that validates against the schema. A schema that is not a valid JSON schema (jsonschema's
meta-schema check) or that xgrammar cannot compile is a 400 naming ``response_format``, before
the request reaches an engine; the engine compiles it once for the request.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.grammar import InvalidGrammar, check_schema
from ..engine.sequence import GrammarSpec
from .api_error import ApiError

PARAM = "response_format"


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> GrammarSpec | None:
        """The engine's grammar (None for text); ApiError 400 for a schema that cannot be used."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return GrammarSpec("json_object")
        if self.json_schema is None or self.json_schema.json_schema is None:
            raise ApiError(400, "response_format of type json_schema needs json_schema.schema", param=PARAM,
                           code="invalid_response_format")
        schema = self.json_schema.json_schema
        _check_meta_schema(schema)
        text = json.dumps(schema)
        try:
            check_schema(text)
        except InvalidGrammar as e:
            raise ApiError(400, str(e), param=PARAM, code="invalid_response_format") from e
        return GrammarSpec("json_schema", text)


def _check_meta_schema(schema: dict[str, Any] | bool) -> None:
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ApiError(400, f"response_format.json_schema.schema is not a valid JSON schema: {e.message}",
                       param=PARAM, code="invalid_response_format") from e
