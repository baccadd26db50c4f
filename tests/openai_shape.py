"""What every answer of a pdserve HTTP route must look like, for the fuzz tests of the router and
the workers: OpenAI's error shape, Authorization headers of every kind, hypothesis' tallies."""

from __future__ import annotations

from hypothesis import currently_in_test_context, event


def bearer(secret: str | bytes | None) -> dict:
    """No header (None), a raw header value (bytes), an empty one (""), or `Bearer <secret>`."""
    if secret is None:
        return {}
    if isinstance(secret, bytes):
        return {"Authorization": secret}
    return {"Authorization": f"Bearer {secret}" if secret else ""}


def assert_openai_error(payload: object, status: int) -> None:
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    err = payload["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] == status and not isinstance(err["code"], bool), err


def note(what: str) -> None:
    """Counted in `--hypothesis-show-statistics`: how the answers spread over the statuses."""
    if currently_in_test_context():
        event(what)
