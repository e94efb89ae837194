//! Which arenas serve which stream. A program's allocations go to one or two hot streams, so the first few
//! streams sit in a short vector searched linearly (the hot stream found in a compare or two, as cheap as a
//! lookup gets); streams past those go to a hash map, so a pool serving thousands of streams (a C ABI caller's
//! stream pools, say) still finds an arena in O(1) rather than scanning them all on every allocation.

use crate::StreamId;
use std::collections::HashMap;

/// Streams kept in the linearly searched vector before the map takes the rest.
const LINEAR: usize = 8;

/// Stream → arena indices `[small, large]`.
#[derive(Debug, Default)]
pub(super) struct StreamArenas {
    first: Vec<(StreamId, [u32; 2])>,
    rest: HashMap<StreamId, [u32; 2]>,
}

impl StreamArenas {
    /// The arenas of `stream`, if it has been used. O(1).
    #[inline(always)]
    pub(super) fn get(&self, stream: StreamId) -> Option<[u32; 2]> {
        match self.first.iter().find(|(s, _)| *s == stream) {
            Some(&(_, arenas)) => Some(arenas),
            None if self.rest.is_empty() => None,
            None => self.rest.get(&stream).copied(),
        }
    }

    /// Records the arenas of a stream not seen before. O(1) amortised.
    pub(super) fn insert(&mut self, stream: StreamId, arenas: [u32; 2]) {
        debug_assert!(self.get(stream).is_none(), "each stream gets its arenas once");
        if self.first.len() < LINEAR {
            self.first.push((stream, arenas));
        } else {
            self.rest.insert(stream, arenas);
        }
    }

    /// Streams served.
    pub(super) fn len(&self) -> usize {
        self.first.len() + self.rest.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_past_the_linear_ones_are_found_in_the_map() {
        let mut streams = StreamArenas::default();
        let arenas = |s: u64| [2 * s as u32, 2 * s as u32 + 1];
        // Ids far apart and out of order, so neither an index nor an order is assumed.
        let ids: Vec<u64> = (0..100u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(streams.get(StreamId(id)), None);
            streams.insert(StreamId(id), arenas(i as u64));
            assert_eq!(streams.len(), i + 1);
        }
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(streams.get(StreamId(id)), Some(arenas(i as u64)), "stream {i}");
        }
        assert_eq!(streams.get(StreamId(12345)), None);
    }

    /// The first `LINEAR` streams go to the vector, searched first; only those after them go to the map.
    #[test]
    fn the_first_streams_sit_in_the_vector_the_rest_in_the_map() {
        let mut streams = StreamArenas::default();
        for s in 0..LINEAR as u64 {
            streams.insert(StreamId(s), [s as u32; 2]);
            assert_eq!((streams.first.len(), streams.rest.len()), (s as usize + 1, 0), "stream {s}");
        }
        for s in LINEAR as u64..3 * LINEAR as u64 {
            streams.insert(StreamId(s), [s as u32; 2]);
            assert_eq!((streams.first.len(), streams.rest.len()), (LINEAR, s as usize + 1 - LINEAR), "stream {s}");
        }
        assert_eq!(streams.len(), 3 * LINEAR);
    }
}
