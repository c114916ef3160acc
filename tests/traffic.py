"""What the multi-process tests read off a rank's recorded traffic."""


def bytes_by_scope(step: dict) -> dict[str, int]:
    """Bytes a rank sent in one optimizer step by scope ("intra", "inter"), from the ``by_op`` rows its worker recorded,
    the control all-reduces left out (a few bytes per parameter, not in the formulas)."""
    sent = {"intra": 0, "inter": 0}
    for op, scope, b in step["by_op"]:
        if op != "control":
            sent[scope] += b
    return sent
