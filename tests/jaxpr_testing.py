"""Helpers that read traced programs (jaxprs) in tests."""


def jit_calls(jaxpr, name: str) -> list:
    """Every `jit` equation named `name` in `jaxpr` (a Jaxpr or ClosedJaxpr) and in its sub-jaxprs.

    Calls that share one traced function (the layers of a model through one module-level jit) hold the same
    jaxpr object in their `jaxpr` parameter, which JAX lowers once."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") == name:
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
                    found += jit_calls(sub, name)
    return found


def shared(eqns) -> int:
    """How many distinct traced functions the `jit` equations call."""
    return len({id(e.params["jaxpr"]) for e in eqns})
