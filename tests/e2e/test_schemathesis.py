"""Property-based fuzzing of the public HTTP contract: no input produces a 5xx.

A real server process is fuzzed over HTTP from its own /openapi.json, with
positive and negative cases, bounded by ``max-examples`` per operation.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from tests.e2e.server import ServerProcess, write_config

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 40


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("fuzz")
    server = ServerProcess(config=write_config(root / "fuzz.yaml"), data_dir=root / "data")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api_schema(fuzzed_server: ServerProcess) -> schemathesis.schemas.BaseSchema:
    config = SchemathesisConfig.from_dict({"generation": {"mode": "all", "max-examples": MAX_EXAMPLES}})
    return schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json", config=config)


def _operations(schema: schemathesis.schemas.BaseSchema) -> list[schemathesis.schemas.APIOperation]:
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_no_input_causes_a_server_error(
    api_schema: schemathesis.schemas.BaseSchema, fuzzed_server: ServerProcess, mode: GenerationMode
) -> None:
    # Driven through hypothesis directly: schemathesis' pytest plugin does not support pytest 9 yet.
    operations = _operations(api_schema)
    assert len(operations) >= 12
    fuzzed = 0
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.generate],
        )
        def fuzz(case: schemathesis.Case) -> None:
            case.call_and_validate(base_url=fuzzed_server.url, checks=[not_a_server_error])

        try:
            fuzz()
        except Unsatisfiable:
            # negative mode: an operation without inputs (GET /v1/gifts) has nothing to break
            assert mode is GenerationMode.NEGATIVE
            continue
        fuzzed += 1
    assert fuzzed >= 10
