"""The public face: squeeze's top-level names stay what they are after the heavy stages are imported."""

import squeeze


def test_compress_stays_a_function_after_the_pipeline_is_imported():
    import squeeze.compression.pipeline  # noqa: F401 - importing a subpackage must not shadow api names

    assert callable(squeeze.compress) and callable(squeeze.evaluate) and callable(squeeze.load)
    assert callable(squeeze.verify_model_integrity)


def test_every_error_class_is_exported():
    import inspect

    from squeeze import errors

    classes = {name for name, obj in vars(errors).items()
               if inspect.isclass(obj) and issubclass(obj, errors.SqueezeError)}
    assert {"LockError", "ResumeError", "Interrupted"} <= classes
    for name in classes:
        assert getattr(squeeze, name) is getattr(errors, name) and name in squeeze.__all__
