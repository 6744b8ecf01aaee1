"""The data-loading helpers, by their public path: ``ElasticSampler`` (a distributed sampler
whose position is global, so it resumes on any world size) and ``WorkerRNG`` (a dataset
wrapper whose worker generators are saved and restored).

They live in ``state/samplers.py``, beside the data-loader state that knows them
(``state/loaders.py``), so that no package imports this root module back.
"""

from snapstate.state.samplers import ElasticSampler, WorkerRNG

__all__ = ["ElasticSampler", "WorkerRNG"]
