"""The user's data, read locally: how many tokens each example holds (`LengthHistogram`).

A plan that knows the data plans for its longest batch (peak memory) and its useful tokens
(padding excluded). Reading a dataset and counting tokens lives in `autofit.data.read`; this
package's plain types import no torch.
"""

from autofit.data.histogram import LengthHistogram

__all__ = ["LengthHistogram"]
