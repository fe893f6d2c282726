"""Entry points: argument parsing and the commands (`python -m megatron_specdec.cli.<tool>`,
the specdec-* console scripts). The only layer that parses arguments."""
