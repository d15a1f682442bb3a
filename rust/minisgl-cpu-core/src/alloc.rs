//! Page allocation and the per-slot page table, mirroring
//! `minisgl.kvcache.allocator.PageAllocator` (same free-page stack order, same slot order).

/// Not enough free pages / slots (Python `OutOfPages`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfPages(pub String);

impl std::fmt::Display for OutOfPages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for OutOfPages {}

#[derive(Debug, Clone)]
pub struct PageAllocator {
    pub num_pages: usize,
    pub page_size: usize,
    pub max_slots: usize,
    pub width: usize,
    /// Stack of free pages: the *last* element is handed out first.
    free_pages: Vec<i32>,
    free_slots: Vec<i32>,
    /// Row-major `[max_slots, width]` map (slot, position) -> KV location.
    page_table: Vec<i32>,
}

impl PageAllocator {
    pub fn new(num_pages: usize, page_size: usize, max_slots: usize, max_seq_len: usize) -> Self {
        let width = max_seq_len.div_ceil(page_size) * page_size;
        PageAllocator {
            num_pages,
            page_size,
            max_slots,
            width,
            free_pages: (0..num_pages as i32).rev().collect(),
            free_slots: (0..max_slots as i32).rev().collect(),
            page_table: vec![0; max_slots * width],
        }
    }

    pub fn num_free_pages(&self) -> usize {
        self.free_pages.len()
    }

    pub fn num_free_slots(&self) -> usize {
        self.free_slots.len()
    }

    pub fn free_pages(&self) -> &[i32] {
        &self.free_pages
    }

    pub fn page_table(&self) -> &[i32] {
        &self.page_table
    }

    pub fn row(&self, slot: usize) -> &[i32] {
        &self.page_table[slot * self.width..(slot + 1) * self.width]
    }

    pub fn row_mut(&mut self, slot: usize) -> &mut [i32] {
        &mut self.page_table[slot * self.width..(slot + 1) * self.width]
    }

    pub fn alloc_slot(&mut self) -> Result<usize, OutOfPages> {
        self.free_slots
            .pop()
            .map(|s| s as usize)
            .ok_or_else(|| OutOfPages("no free request slot".into()))
    }

    pub fn free_slot(&mut self, slot: usize) {
        self.free_slots.push(slot as i32);
    }

    /// Give `slot` `num_pages` new pages covering positions `[start, start + n * ps)`.
    pub fn alloc_pages(
        &mut self,
        slot: usize,
        start: usize,
        num_pages: usize,
    ) -> Result<(), OutOfPages> {
        if num_pages > self.free_pages.len() {
            return Err(OutOfPages(format!(
                "need {num_pages} pages, {} free",
                self.free_pages.len()
            )));
        }
        let ps = self.page_size;
        let base = slot * self.width + start;
        for k in 0..num_pages {
            let page = self.free_pages.pop().expect("checked above");
            let dst = &mut self.page_table[base + k * ps..base + (k + 1) * ps];
            for (o, d) in dst.iter_mut().enumerate() {
                *d = page * ps as i32 + o as i32;
            }
        }
        Ok(())
    }

    /// Return the pages owning these page-aligned token locations (pushed in reverse, so the
    /// first page of `locs` is handed out next, as in Python).
    pub fn free_locations(&mut self, locs: &[i32]) {
        let ps = self.page_size;
        let ps_i = ps as i32;
        self.free_pages
            .extend(locs.iter().step_by(ps).rev().map(|&l| l / ps_i));
    }

    /// Free the page-aligned locations `row(slot)[a..b]` (no temporary copy).
    pub fn free_row_range(&mut self, slot: usize, a: usize, b: usize) {
        if b <= a {
            return;
        }
        let ps = self.page_size;
        let ps_i = ps as i32;
        let base = slot * self.width;
        let (pt, fp) = (&self.page_table, &mut self.free_pages);
        fp.extend(
            pt[base + a..base + b]
                .iter()
                .step_by(ps)
                .rev()
                .map(|&l| l / ps_i),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowest_pages_first() {
        let mut a = PageAllocator::new(4, 2, 2, 8);
        let s = a.alloc_slot().unwrap();
        assert_eq!(s, 0);
        a.alloc_pages(s, 0, 2).unwrap();
        assert_eq!(&a.row(0)[..4], &[0, 1, 2, 3]);
        a.free_locations(&[0, 1, 2, 3]);
        assert_eq!(a.free_pages(), &[3, 2, 1, 0]);
        assert!(a.alloc_pages(s, 0, 5).is_err());
    }
}
