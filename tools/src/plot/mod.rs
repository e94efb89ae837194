//! Timeline plots in the spirit of PyTorch's memory_viz "Active Memory Timeline": memory over time per device,
//! every live allocation a band stacked on those allocated before it (so a free makes the bands above it drop),
//! the peak marked. The output is one self-contained SVG (tooltips through `<title>`, no script) that opens in
//! any browser.
//!
//! Input is a [`Snapshot`] with recorded events, or a trace (x is then the op number). To keep files small, only
//! the `max_shapes` largest allocations get a band of their own; the others are summed into one grey "other"
//! band on top, sampled per pixel column at its highest point.

mod svg;
mod timeline;

pub use svg::{render_svg, write_svg};
pub use timeline::{Panel, PlotOptions, Span, Timeline, MAX_PIXELS};
#[cfg(doc)]
use umm::Snapshot;

#[cfg(test)]
mod tests;
