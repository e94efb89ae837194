//! A reader for the pickle opcodes that build plain data. Objects live in one arena and are referred to by
//! index, so the memo shares them as Python does (a `frames` list referenced from a thousand events is stored
//! once) and a self-referencing list needs nothing special.

mod machine;
mod opcodes;

pub(super) use machine::parse;

/// A value on the stack, in the memo or in a container.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer beyond `i64`, as an index into [`Pickle::wide`].
    Wide(u32),
    /// An integer beyond `i128`: no field of a snapshot holds one.
    Huge,
    Float(f64),
    /// A string, bytes or container, as an index into [`Pickle::objects`].
    Obj(u32),
}

#[derive(Debug)]
pub(super) enum Object {
    Str(Box<str>),
    /// Bytes are never read from a snapshot: only their kind is kept.
    Bytes,
    List(Vec<Value>),
    Tuple(Vec<Value>),
    Set(Vec<Value>),
    Dict(Vec<(Value, Value)>),
}

/// A parsed pickle.
#[derive(Debug)]
pub(super) struct Pickle {
    pub(super) root: Value,
    pub(super) protocol: u8,
    objects: Vec<Object>,
    wide: Vec<i128>,
}

/// Where a pickle goes wrong.
#[derive(Debug)]
pub(super) struct Error {
    pub(super) offset: usize,
    pub(super) what: String,
}

/// Bounds on a pickle's structure, beyond which a file is refused as absurd rather than read.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// MARKs open at once (a snapshot nests a handful).
    pub(super) marks: usize,
    /// Values held in all (stack, memo, containers): a few per byte of a real snapshot at most.
    pub(super) values: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self { marks: 1024, values: 1 << 30 }
    }
}

impl Pickle {
    fn object(&self, value: Value) -> Option<&Object> {
        match value {
            Value::Obj(i) => self.objects.get(i as usize),
            _ => None,
        }
    }

    pub(super) fn dict(&self, value: Value) -> Option<&[(Value, Value)]> {
        match self.object(value) {
            Some(Object::Dict(items)) => Some(items),
            _ => None,
        }
    }

    /// A list or tuple's items.
    pub(super) fn list(&self, value: Value) -> Option<&[Value]> {
        match self.object(value) {
            Some(Object::List(items) | Object::Tuple(items)) => Some(items),
            _ => None,
        }
    }

    pub(super) fn str(&self, value: Value) -> Option<&str> {
        match self.object(value) {
            Some(Object::Str(s)) => Some(s),
            _ => None,
        }
    }

    pub(super) fn int(&self, value: Value) -> Option<i128> {
        match value {
            Value::Int(n) => Some(n.into()),
            Value::Wide(i) => self.wide.get(i as usize).copied(),
            _ => None,
        }
    }

    /// The value of `key` in a dict's items: the last one, as a Python dict keeps.
    pub(super) fn get(&self, items: &[(Value, Value)], key: &str) -> Option<Value> {
        items.iter().rev().find(|&&(k, _)| self.str(k) == Some(key)).map(|&(_, v)| v)
    }

    /// A value in words, for errors: its kind, and the value itself where it is short.
    pub(super) fn describe(&self, value: Value) -> String {
        match value {
            Value::None => "None".into(),
            Value::Bool(b) => if b { "True" } else { "False" }.into(),
            Value::Int(_) | Value::Wide(_) => format!("the integer {}", self.int(value).unwrap_or_default()),
            Value::Huge => "an integer wider than 128 bits".into(),
            Value::Float(f) => format!("the float {f}"),
            Value::Obj(_) => match self.object(value) {
                Some(Object::Str(_)) => format!("the string {}", self.quote(value)),
                Some(Object::Bytes) => "bytes".into(),
                Some(Object::List(items)) => format!("a list of {}", items.len()),
                Some(Object::Tuple(items)) => format!("a tuple of {}", items.len()),
                Some(Object::Set(items)) => format!("a set of {}", items.len()),
                Some(Object::Dict(items)) => format!("a dict of {} keys", items.len()),
                None => "nothing".into(),
            },
        }
    }

    /// A dict key or string for a message: quoted, control characters escaped, cut after 40 characters.
    pub(super) fn quote(&self, value: Value) -> String {
        match self.str(value) {
            Some(s) => {
                let mut text: String = s.chars().take(40).flat_map(char::escape_debug).collect();
                if s.chars().nth(40).is_some() {
                    text.push_str("...");
                }
                format!("'{text}'")
            }
            None => self.describe(value),
        }
    }
}
