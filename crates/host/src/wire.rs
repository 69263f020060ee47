//! The strict JSON decoding lives in `kvpages_wire::json`, shared with the browser
//! simulator; this re-exports what the host's own formats (SGLang's persistence file) use.

pub(crate) use kvpages_wire::json::{KeyPage, List, Members, Object, U32, decode, missing, value};
