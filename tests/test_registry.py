import pytest

from fp8rl.registry import Registry, RegistryError


def make():
    reg = Registry("widget")

    @reg.register("a")
    def a():
        return "A"

    @reg.register("b")
    class B:
        pass

    return reg


def test_register_and_lookup():
    reg = make()
    assert reg["a"]() == "A"
    assert reg.names() == ["a", "b"]
    assert "a" in reg and "zzz" not in reg
    assert len(reg) == 2 and set(reg) == {"a", "b"}
    assert reg.check("b") == "b"


def test_decorator_returns_the_object_unchanged():
    reg = Registry("widget")

    def f():
        return 1

    assert reg.register("f")(f) is f


def test_duplicate_raises():
    reg = make()
    with pytest.raises(RegistryError, match="widget 'a' is already registered"):
        reg.register("a")(lambda: None)


def test_unknown_lists_valid_names():
    reg = make()
    with pytest.raises(RegistryError) as e:
        reg["c"]
    assert str(e.value) == "unknown widget 'c'; valid names are: a, b"
    with pytest.raises(KeyError):  # a RegistryError is a KeyError for Mapping semantics
        reg.check("c")


@pytest.mark.parametrize("bad", ["", None, 3])
def test_bad_name_raises(bad):
    with pytest.raises(ValueError, match="non-empty string"):
        Registry("widget").register(bad)


def test_kind_required():
    with pytest.raises(ValueError):
        Registry("")
