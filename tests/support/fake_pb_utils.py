"""A stand-in for `triton_python_backend_utils`, which exists only inside Triton's stub process, so the
adapters' own logic can be unit-tested. Only what the adapters use; the real module is exercised by test_server."""

import types

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


class TritonError:
    INVALID_ARG, INTERNAL = "INVALID_ARG", "INTERNAL"

    def __init__(self, message, code=INTERNAL):
        self.message, self.code = message, code


class Tensor:
    def __init__(self, name, array):
        self.name, self.array = name, array

    def as_numpy(self):
        return self.array


class InferenceResponse:
    def __init__(self, output_tensors, error=None):
        self.outputs = {t.name: t.array for t in output_tensors}
        self.error = error

    def has_error(self):
        return self.error is not None

    def output_tensors(self):
        return [Tensor(name, array) for name, array in self.outputs.items()]


metric_calls = []  # (family name, labels, "set" | "increment" | "observe", value), in the order made


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "COUNTER", "GAUGE", "HISTOGRAM"

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels, buckets=None):
        family = self.name

        class Metric:
            def set(self, value):
                metric_calls.append((family, labels, "set", value))

            def increment(self, value):
                metric_calls.append((family, labels, "increment", value))

            def observe(self, value):
                metric_calls.append((family, labels, "observe", value))

        return Metric()


def get_input_tensor_by_name(request, name):
    return request.get(name)


def get_output_tensor_by_name(response, name):
    array = response.outputs.get(name)
    return None if array is None else Tensor(name, array)


def install(sys_modules):
    module = types.ModuleType("triton_python_backend_utils")
    for name, value in dict(globals()).items():
        if not name.startswith("_") and name not in ("install", "types"):
            setattr(module, name, value)
    sys_modules["triton_python_backend_utils"] = module
