"""Writers of the work that tests and benchmarks share, kept out of the package (nothing imports them
at run time): the bundled sample datasets (``make_samples``), the reference run's sources at any size
(``rehearsal``) and the simulator's borrowing workload (``borrowing``). A benchmark imports them as a
test does; what they write ships in the package (``expansion_dag/samples/``)."""
