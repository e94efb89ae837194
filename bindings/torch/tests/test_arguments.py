"""umm_torch's checks that need neither PyTorch nor the library: arguments refused before they reach the C ABI,
and calls that need PyTorch saying so when it is absent. Run: python3 -m unittest discover bindings/torch/tests
(or, from a checkout, PYTHONPATH=bindings/torch python3 -m unittest bindings/torch/tests/test_arguments.py)."""

import importlib.util
import os
import unittest
from unittest import mock

import umm_torch

TORCH = importlib.util.find_spec("torch") is not None


class Arguments(unittest.TestCase):
    def test_a_limit_is_a_whole_number_of_bytes_not_negative(self):
        for bad in (-1, -(1 << 20), 1.5, "1GiB", None, True):
            with self.assertRaises(ValueError) as caught:
                umm_torch.set_limit(bad)
            self.assertIn("whole number of bytes", str(caught.exception))


@unittest.skipIf(TORCH, "PyTorch is installed: the calls that need it work")
class WithoutTorch(unittest.TestCase):
    # On simulated devices (UMM_CAPI_SIM, which other suites of a discover run set when imported) umm's figures stand
    # without PyTorch; here the calls must meet the real devices' case.
    @mock.patch.dict(os.environ, {"UMM_CAPI_SIM": ""})
    def test_calls_that_need_torch_say_so_and_what_works_without_it(self):
        for name, call in (("enable", umm_torch.enable), ("memory_stats", umm_torch.memory_stats),
                           ("memory_summary", umm_torch.memory_summary), ("empty_cache", umm_torch.empty_cache),
                           ("memory_allocated", umm_torch.memory_allocated)):
            with self.assertRaises(ModuleNotFoundError) as caught:
                call()
            message = str(caught.exception)
            self.assertIn(f"umm_torch.{name}() needs PyTorch", message)
            self.assertIn("pip install torch", message)
            self.assertIn("UMM_CAPI_SIM", message)
            self.assertEqual(caught.exception.name, "torch")


if __name__ == "__main__":
    unittest.main()
