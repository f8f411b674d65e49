"""The public face: squeeze's top-level names stay what they are after the heavy stages are imported."""

import squeeze


def test_compress_stays_a_function_after_the_pipeline_is_imported():
    import squeeze.compression.runner  # noqa: F401 - importing a subpackage must not shadow api names

    assert callable(squeeze.compress) and callable(squeeze.evaluate) and callable(squeeze.load)
    assert callable(squeeze.verify_model_integrity)


def test_every_error_class_is_exported():
    import inspect

    from squeeze import errors

    classes = {
        name for name, obj in vars(errors).items() if inspect.isclass(obj) and issubclass(obj, errors.SqueezeError)
    }
    assert {"LockError", "ResumeError", "Interrupted"} <= classes
    for name in classes:
        assert getattr(squeeze, name) is getattr(errors, name) and name in squeeze.__all__


def test_builtin_names_are_sorted_and_name_what_the_loaders_accept():
    from squeeze import api
    from squeeze.config import load_calibration_spec, load_recipe

    recipes, specs = api.builtin_recipes(), api.builtin_calibration_specs()
    assert {"w4", "rtn-w4"} <= set(recipes) and recipes == sorted(recipes)
    assert specs and specs == sorted(specs)
    load_recipe(recipes[0])
    load_calibration_spec(specs[0])


def test_check_generate_options_runs_the_cheap_checks_in_order():
    import pytest

    from squeeze import api
    from squeeze.errors import ConfigError

    assert api.check_generate_options("Hi") == ["Hi"]
    assert api.check_generate_options(["a", "b"], kv_bits=16) == ["a", "b"]
    # several bad options: the prompt options first, then the device, then the KV cache
    with pytest.raises(ConfigError, match="max_new_tokens"):
        api.check_generate_options("Hi", max_new_tokens=0, device="mps", kv_bits=5)
    with pytest.raises(ConfigError, match="not supported"):
        api.check_generate_options("Hi", device="mps", kv_bits=5)
    with pytest.raises(ConfigError, match="--kv-bits"):
        api.check_generate_options("Hi", kv_bits=5)
    with pytest.raises(ConfigError, match="--kv-dynamic"):
        api.check_generate_options("Hi", kv_dynamic=True)


def test_check_calibrate_kv_options_names_the_flags():
    import pytest

    from squeeze import api
    from squeeze.errors import ConfigError

    api.check_calibrate_kv_options(8, 0)
    api.check_calibrate_kv_options(4, 4)
    with pytest.raises(ConfigError, match="--bits"):
        api.check_calibrate_kv_options(5, 4)
    with pytest.raises(ConfigError, match="--sink-tokens"):
        api.check_calibrate_kv_options(8, -1)


def test_short_path_keeps_the_tail():
    from squeeze import api

    assert api.short_path("a/b") == "a/b"
    long = "d/" * 100 + "model.safetensors"
    assert api.short_path(long).startswith("...") and api.short_path(long).endswith("model.safetensors")


def test_every_verb_of_the_api_package_is_exported_by_squeeze():
    """Issue 49 item 2: squeeze/api/ is split by verb; api/__init__ and squeeze/__init__ re-export every verb
    (a function of a verb module), and importing a verb module by name does not shadow its verb."""
    import importlib
    import inspect

    from squeeze import api

    modules = [
        importlib.import_module(f"squeeze.api.{name}") for name in ("artifact", "compress", "run", "serve", "eval")
    ]
    verbs = {name for module in modules for name in module.__all__ if inspect.isfunction(getattr(module, name))}
    assert {"compress", "generate", "serve_engine", "evaluate", "verify_model_integrity", "register"} <= verbs
    for name in verbs:
        assert getattr(api, name) is getattr(squeeze, name) and name in squeeze.__all__ and name in api.__all__
    assert callable(api.compress) and callable(squeeze.compress)  # the function, not the module api/compress.py


def test_api_exports_every_support_name_and_each_name_once():
    """squeeze.api's __all__ is the verbs followed by squeeze.api.support's __all__ (built from it, not copied):
    every support name is exported as the same object, and no name is listed twice."""
    from squeeze import api
    from squeeze.api import support

    assert {"EngineConfig", "SamplingParams", "parse_size", "VerifyReport"} <= set(support.__all__)
    assert api.__all__[-len(support.__all__) :] == support.__all__ and api.__all__ is not support.__all__
    assert len(set(api.__all__)) == len(api.__all__)
    for name in api.__all__:
        assert hasattr(api, name), name
    for name in support.__all__:
        assert getattr(api, name) is getattr(support, name), name


def test_import_squeeze_registers_nothing_and_imports_no_heavy_library():
    import subprocess
    import sys

    code = (
        "import sys, squeeze\n"
        "from squeeze.runtime import hf_hook\n"
        "assert hf_hook._FINDER not in sys.meta_path, 'import squeeze installed the transformers hook'\n"
        "assert 'transformers' not in sys.modules and 'lm_eval' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
