"""Exports of converted (MLA) checkpoints to formats that stock inference engines load without remote code:
DeepSeek-V3 (`deepseek_v3`: which checkpoints qualify, `requirements`; the identity latent norm, `latent_norm`;
the weights and config, `deepseek_v3`), and `tiny`: tiny ladder conversions that the export takes (tests, GPU check)."""
