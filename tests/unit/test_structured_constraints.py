def test_objects_are_closed_unless_the_schema_says_otherwise():
    from kvserve.structured.constraints import closed_objects

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "c": {
                "type": "object",
                "additionalProperties": True,
                "properties": {"d": {"type": "string"}},
            },
        },
        "allOf": [{"properties": {"e": {"type": "string"}}}],
        "$defs": {"x": {"type": "object", "properties": {"y": {"type": "string"}}}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] is True  # said explicitly
    assert "additionalProperties" not in closed["allOf"][0]  # a branch lists only part
    assert closed["$defs"]["x"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is not changed
    open_required = closed_objects({"type": "object", "required": ["x"], "properties": {"y": {}}})
    assert "additionalProperties" not in open_required  # x must stay possible
