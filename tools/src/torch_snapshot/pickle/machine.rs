//! The stack machine that runs a pickle's opcodes into an arena of objects, with its stack, MARKs and memo,
//! checking lengths and counts against the [`Limits`] before anything is allocated.

use super::opcodes::{opcode_name, refusal};
use super::{Error, Limits, Object, Pickle, Value};

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    /// Offset of the opcode being run, for errors.
    at: usize,
    op: u8,
    stack: Vec<Value>,
    /// Stack lengths at each open MARK.
    marks: Vec<usize>,
    memo: Vec<Value>,
    objects: Vec<Object>,
    wide: Vec<i128>,
    protocol: u8,
    /// Values held in all, against `limits.values`.
    values: usize,
    limits: Limits,
}

/// Parses a whole pickle (up to its STOP; bytes after it are ignored, as Python's `pickle.load` does).
pub(in crate::torch_snapshot) fn parse(data: &[u8], limits: Limits) -> Result<Pickle, Error> {
    match data.first() {
        None => return Err(Error { offset: 0, what: "the file is empty".into() }),
        Some(&0x80) => {}
        Some(&first) => {
            return Err(Error {
                offset: 0,
                what: format!(
                    "the file starts with 0x{first:02x}, not 0x80 (the PROTO opcode that starts a pickle of \
                     protocol 2 or later, as torch.cuda.memory._dump_snapshot writes)"
                ),
            });
        }
    }
    let mut m = Machine {
        data,
        pos: 0,
        at: 0,
        op: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Vec::new(),
        objects: Vec::new(),
        wide: Vec::new(),
        protocol: 0,
        values: 0,
        limits,
    };
    let root = m.run()?;
    Ok(Pickle { root, protocol: m.protocol, objects: m.objects, wide: m.wide })
}

impl Machine<'_> {
    fn name(&self) -> &'static str {
        opcode_name(self.op).unwrap_or("?")
    }

    fn error(&self, what: impl Into<String>) -> Error {
        Error { offset: self.at, what: format!("{} (0x{:02x}): {}", self.name(), self.op, what.into()) }
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&[u8], Error> {
        let left = self.data.len() - self.pos;
        match usize::try_from(n) {
            Ok(n) if n <= left => {
                let bytes = &self.data[self.pos..self.pos + n];
                self.pos += n;
                Ok(bytes)
            }
            _ => Err(self.error(format!("the file ends inside its {what} of {n} bytes ({left} left): truncated"))),
        }
    }

    fn u8(&mut self) -> Result<u8, Error> {
        Ok(self.take(1, "argument")?[0])
    }

    fn le<const N: usize>(&mut self) -> Result<[u8; N], Error> {
        let mut bytes = [0u8; N];
        bytes.copy_from_slice(self.take(N as u64, "argument")?);
        Ok(bytes)
    }

    fn count(&mut self, n: usize) -> Result<(), Error> {
        self.values = self.values.saturating_add(n);
        if self.values > self.limits.values {
            return Err(self.error(format!(
                "more than {} values in all: refused as absurd for a memory snapshot",
                self.limits.values
            )));
        }
        Ok(())
    }

    fn push(&mut self, value: Value) -> Result<(), Error> {
        self.count(1)?;
        self.stack.push(value);
        Ok(())
    }

    fn new_object(&mut self, object: Object) -> Result<(), Error> {
        let index = u32::try_from(self.objects.len()).map_err(|_| self.error("more than 2^32 objects"))?;
        self.objects.push(object);
        self.push(Value::Obj(index))
    }

    /// The stack's floor: values below the innermost MARK belong to an outer container.
    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self) -> Result<Value, Error> {
        if self.stack.len() <= self.floor() {
            return Err(self.error("finds no value on the stack (above the last MARK) to take"));
        }
        self.stack.pop().ok_or_else(|| self.error("finds an empty stack"))
    }

    fn top(&self) -> Result<Value, Error> {
        match self.stack.last() {
            Some(&v) if self.stack.len() > self.floor() => Ok(v),
            _ => Err(self.error("finds no value on the stack (above the last MARK)")),
        }
    }

    fn pop_mark(&mut self) -> Result<Vec<Value>, Error> {
        let mark = self.marks.pop().ok_or_else(|| self.error("has no MARK before it"))?;
        Ok(self.stack.split_off(mark.min(self.stack.len())))
    }

    /// The container at the top of the stack, which `APPEND`, `SETITEM` and the like fill, if it is the
    /// kind `expected` names.
    fn target(&mut self, expected: &str) -> Result<&mut Object, Error> {
        let top = self.top()?;
        let is_kind = |o: &Object| match expected {
            "list" => matches!(o, Object::List(_)),
            "dict" => matches!(o, Object::Dict(_)),
            _ => matches!(o, Object::Set(_)),
        };
        let index = match top {
            Value::Obj(i) if self.objects.get(i as usize).is_some_and(is_kind) => i as usize,
            _ => return Err(self.error(format!("the value below it is not a {expected}"))),
        };
        Ok(&mut self.objects[index])
    }

    fn extend_list(&mut self, items: Vec<Value>) -> Result<(), Error> {
        if let Object::List(list) = self.target("list")? {
            list.extend(items);
        }
        Ok(())
    }

    fn extend_dict(&mut self, items: Vec<Value>) -> Result<(), Error> {
        if !items.len().is_multiple_of(2) {
            return Err(self.error(format!("has {} values after its MARK: keys and values do not pair", items.len())));
        }
        if let Object::Dict(dict) = self.target("dict")? {
            dict.extend(items.chunks_exact(2).map(|kv| (kv[0], kv[1])));
        }
        Ok(())
    }

    fn string(&mut self, len: u64) -> Result<(), Error> {
        let bytes = self.take(len, "string")?;
        // Python writes lone surrogates (a file name in a foreign encoding) in its own way: replaced here,
        // since strings only name keys and actions.
        let text = String::from_utf8_lossy(bytes).into_owned().into_boxed_str();
        self.count(text.len() / 16)?;
        self.new_object(Object::Str(text))
    }

    fn bytes(&mut self, len: u64) -> Result<(), Error> {
        self.take(len, "bytes")?;
        self.new_object(Object::Bytes)
    }

    /// A little-endian two's complement integer of `LONG1` or `LONG4`.
    fn long(&mut self, len: u64) -> Result<(), Error> {
        let bytes = self.take(len, "integer")?;
        let value = if bytes.len() > 16 {
            // Wider than 128 bits unless it is only sign extension.
            let (low, high) = bytes.split_at(16);
            let fill = if low[15] & 0x80 != 0 { 0xff } else { 0 };
            if high.iter().all(|&b| b == fill) {
                Some(i128::from_le_bytes(low.try_into().unwrap_or([0; 16])))
            } else {
                None
            }
        } else if bytes.is_empty() {
            Some(0)
        } else {
            let fill = if bytes[bytes.len() - 1] & 0x80 != 0 { 0xff } else { 0 };
            let mut wide = [fill; 16];
            wide[..bytes.len()].copy_from_slice(bytes);
            Some(i128::from_le_bytes(wide))
        };
        let value = match value {
            None => Value::Huge,
            Some(n) => match i64::try_from(n) {
                Ok(n) => Value::Int(n),
                Err(_) => {
                    let index = u32::try_from(self.wide.len()).map_err(|_| self.error("too many integers"))?;
                    self.wide.push(n);
                    Value::Wide(index)
                }
            },
        };
        self.push(value)
    }

    fn memo_put(&mut self, index: u64) -> Result<(), Error> {
        let value = self.top()?;
        let len = self.memo.len() as u64;
        if index < len {
            self.memo[index as usize] = value;
        } else if index == len {
            self.count(1)?;
            self.memo.push(value);
        } else {
            return Err(
                self.error(format!("stores memo entry {index} while {len} are stored: Python numbers them in order"))
            );
        }
        Ok(())
    }

    fn memo_get(&mut self, index: u64) -> Result<(), Error> {
        let value = usize::try_from(index).ok().and_then(|i| self.memo.get(i).copied());
        let value = value
            .ok_or_else(|| self.error(format!("reads memo entry {index}, but only {} are stored", self.memo.len())))?;
        self.push(value)
    }

    fn run(&mut self) -> Result<Value, Error> {
        loop {
            self.at = self.pos;
            let Some(&op) = self.data.get(self.pos) else {
                return Err(Error {
                    offset: self.pos,
                    what: "the file ends before the pickle's STOP opcode: truncated".into(),
                });
            };
            self.op = op;
            self.pos += 1;
            match op {
                0x80 => {
                    let version = self.u8()?;
                    if version > 5 {
                        return Err(self.error(format!("protocol {version}; this reader knows protocols 2 to 5")));
                    }
                    self.protocol = version;
                }
                0x95 => {
                    // Frames only group opcodes for buffered reading; one longer than the rest is a cut file.
                    let len = u64::from_le_bytes(self.le()?);
                    let left = (self.data.len() - self.pos) as u64;
                    if len > left {
                        return Err(self.error(format!("a frame of {len} bytes, but {left} follow: truncated")));
                    }
                }
                b'.' => return self.pop(),
                b'(' => {
                    if self.marks.len() >= self.limits.marks {
                        return Err(self.error(format!(
                            "more than {} MARKs open at once: refused as absurd for a memory snapshot",
                            self.limits.marks
                        )));
                    }
                    self.marks.push(self.stack.len());
                }
                b'0' => {
                    if self.stack.len() > self.floor() {
                        self.pop()?;
                    } else {
                        self.pop_mark()?;
                    }
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let top = self.top()?;
                    self.push(top)?;
                }
                b'N' => self.push(Value::None)?,
                0x88 => self.push(Value::Bool(true))?,
                0x89 => self.push(Value::Bool(false))?,
                b'J' => {
                    let n = i32::from_le_bytes(self.le()?);
                    self.push(Value::Int(n.into()))?;
                }
                b'K' => {
                    let n = self.u8()?;
                    self.push(Value::Int(n.into()))?;
                }
                b'M' => {
                    let n = u16::from_le_bytes(self.le()?);
                    self.push(Value::Int(n.into()))?;
                }
                0x8a => {
                    let len = self.u8()?;
                    self.long(len.into())?;
                }
                0x8b => {
                    let len = i32::from_le_bytes(self.le()?);
                    let len = u64::try_from(len).map_err(|_| self.error(format!("a negative length {len}")))?;
                    self.long(len)?;
                }
                b'G' => {
                    let f = f64::from_be_bytes(self.le()?);
                    self.push(Value::Float(f))?;
                }
                0x8c => {
                    let len = self.u8()?;
                    self.string(len.into())?;
                }
                b'X' => {
                    let len = u32::from_le_bytes(self.le()?);
                    self.string(len.into())?;
                }
                0x8d => {
                    let len = u64::from_le_bytes(self.le()?);
                    self.string(len)?;
                }
                b'C' => {
                    let len = self.u8()?;
                    self.bytes(len.into())?;
                }
                b'B' => {
                    let len = u32::from_le_bytes(self.le()?);
                    self.bytes(len.into())?;
                }
                0x8e | 0x96 => {
                    let len = u64::from_le_bytes(self.le()?);
                    self.bytes(len)?;
                }
                b')' => self.new_object(Object::Tuple(Vec::new()))?,
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    if self.stack.len() < self.floor() + n {
                        return Err(self.error(format!("needs {n} values on the stack (above the last MARK)")));
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.new_object(Object::Tuple(items))?;
                }
                b't' => {
                    let items = self.pop_mark()?;
                    self.new_object(Object::Tuple(items))?;
                }
                b']' => self.new_object(Object::List(Vec::new()))?,
                b'l' => {
                    let items = self.pop_mark()?;
                    self.new_object(Object::List(items))?;
                }
                b'a' => {
                    let value = self.pop()?;
                    self.extend_list(vec![value])?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    self.extend_list(items)?;
                }
                b'}' => self.new_object(Object::Dict(Vec::new()))?,
                b'd' => {
                    let items = self.pop_mark()?;
                    self.new_object(Object::Dict(Vec::new()))?;
                    self.extend_dict(items)?;
                }
                b's' => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    self.extend_dict(vec![key, value])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.extend_dict(items)?;
                }
                0x8f => self.new_object(Object::Set(Vec::new()))?,
                0x90 => {
                    let items = self.pop_mark()?;
                    if let Object::Set(set) = self.target("set")? {
                        set.extend(items);
                    }
                }
                0x91 => {
                    let items = self.pop_mark()?;
                    self.new_object(Object::Set(items))?;
                }
                0x94 => {
                    let next = self.memo.len() as u64;
                    self.memo_put(next)?;
                }
                b'q' => {
                    let index = self.u8()?;
                    self.memo_put(index.into())?;
                }
                b'r' => {
                    let index = u32::from_le_bytes(self.le()?);
                    self.memo_put(index.into())?;
                }
                b'h' => {
                    let index = self.u8()?;
                    self.memo_get(index.into())?;
                }
                b'j' => {
                    let index = u32::from_le_bytes(self.le()?);
                    self.memo_get(index.into())?;
                }
                op if opcode_name(op).is_some() => {
                    return Err(self.error(format!("refused: {}", refusal(op))));
                }
                op => {
                    return Err(Error {
                        offset: self.at,
                        what: format!("0x{op:02x} is not a pickle opcode: the file is corrupt or not a pickle"),
                    });
                }
            }
        }
    }
}
